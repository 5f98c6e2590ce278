"""Our own bounded lines to the c10d store of the default process group.

A line is one connection of ours (``clone()`` of the host's default store: the host's
store object, its timeout and its socket are never touched) and one daemon thread that
runs the operations submitted to it, in order. Callers wait for an operation in slices
(``SLICE_S``): Ctrl-C reaches the host within a slice, and a store host that stops
answering costs a caller at most its deadline. An operation given up before it started
never runs; one that failed drops its connection (a request that ran out of time may
still be answered on it), and a connection that broke marks the store host gone: no line
connects to it again (its open connections still carry what is queued on them). After ``fork()`` the child has no line.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

SLICE_S = 0.1  # longest uninterrupted wait of the calling thread


class StoreUnavailable(RuntimeError):
    """No default store (torch.distributed not initialised), or it cannot be reached."""


class StoreTimeout(RuntimeError):
    """An operation did not complete before the caller's deadline."""


class _Op:
    __slots__ = ("fn", "done", "value", "error", "started", "cancelled", "failed")

    def __init__(self, fn: Callable[[Any], Any], failed: Optional[Callable] = None):
        self.fn, self.done, self.value, self.error = fn, threading.Event(), None, None
        self.started = self.cancelled = False
        self.failed = failed  # told the error when the line could not connect for it


class StoreLine:
    """One connection and its thread."""

    def __init__(self, opener: Callable[[], Any]):
        self._opener = opener
        self._store = None
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Condition(threading.Lock())
        self._thread: Optional[threading.Thread] = None
        self.epoch = _epoch  # the default group this line's store belongs to
        self._closed = False  # its group was replaced: the thread ends once the queue is empty

    def _run(self):
        while True:
            with self._wake:
                while not self._queue:
                    if self._closed:  # nothing left of a replaced group: the thread ends,
                        self._store = None  # and our connection with it
                        return
                    self._wake.wait()
            if self._store is None:  # connect before any op counts as started: an op given
                try:                 # up meanwhile is then never sent
                    if self._closed:  # never the new group's store for an old round
                        raise StoreUnavailable("the process group of this line was replaced")
                    if _gone is not None and self.epoch == _epoch:  # no new connection to a
                        raise StoreUnavailable(_gone)  # store host known to be gone
                    self._store = self._opener()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting op
                    with self._wake:
                        op = self._queue.popleft() if self._queue else None
                    if op is not None:
                        op.error = exc
                        op.done.set()
                        if op.failed is not None:
                            try:
                                op.failed(exc)
                            except Exception:  # noqa: BLE001 - the line's thread goes on
                                pass
                    continue
            with self._wake:
                if not self._queue:
                    continue
                op = self._queue.popleft()
                if op.cancelled:
                    op.done.set()
                    continue
                op.started = True
            try:  # (on a connection that is open, even once the host is known gone: one
                # connection's reset is not every connection's, and a dead host's socket
                # fails at once)
                op.value = op.fn(self._store)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                op.error = exc
                _note_failure(exc, self.epoch)
                self._store = None  # the next operation opens a new connection
            finally:
                op.done.set()

    def close(self) -> None:
        """The line's group was replaced: its thread sends what is still queued (an old
        round's abort or clean-up), then ends."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def warm(self) -> None:
        """Connect and start the thread now, off any decision's path."""
        if self._store is None and (self._thread is None or not self._thread.is_alive()):
            self.submit(lambda _s: None)

    def submit(self, fn: Callable[[Any], Any], failed: Optional[Callable] = None) -> _Op:
        """Queue ``fn(store)``; ``failed(exc)`` is called (on the line's thread) when the
        line cannot connect for it, so ``fn`` never runs."""
        op = _Op(fn, failed)
        with self._wake:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fiws-store", daemon=True)
                self._thread.start()
            self._queue.append(op)
            self._wake.notify()
        return op

    def call(self, fn: Callable[[Any], Any], deadline: float):
        """Run ``fn(store)`` on the line; wait until it is done or ``deadline`` (monotonic).
        Given up (deadline, Ctrl-C) before it started, it never runs."""
        op = self.submit(fn)
        try:
            return wait_op(op, deadline)
        except BaseException:
            with self._wake:
                if not op.started:
                    op.cancelled = True
            raise


def wait_op(op: "_Op", deadline: float):
    """Wait for a submitted operation in slices until ``deadline`` (monotonic): its value,
    its error raised (``plain``), or ``StoreTimeout``."""
    while not op.done.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreTimeout("the c10d store did not answer in time")
        op.done.wait(min(left, SLICE_S))
    if op.error is not None:
        raise plain(op.error)
    return op.value


def _open_clone(strict: bool = False):
    """Our own connection to the default store (same keys, same prefix as the host's).
    A store without ``clone()`` is used as it is, except for the waiting line (``strict``):
    a blocking read there would hold up the host's own operations on that object."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    try:
        mine = store.clone()
    except Exception:  # noqa: BLE001 - a store without clone()
        if strict:
            raise StoreUnavailable("the default store cannot be cloned: no waiting line")
        return store
    try:
        mine.set_timeout(datetime.timedelta(seconds=_op_timeout_s))
    except Exception:  # noqa: BLE001
        pass
    return mine


_gone: Optional[str] = None  # why the store host is known to be gone (a broken connection)
_epoch = 0  # the default group's generation in this process (bumped by check_world)


def epoch() -> int:
    """Which default process group this process is on: a decision that began under another
    one belongs to a group that is gone, and its answer is not kept (``check_world``)."""
    return _epoch


def _note_failure(exc: BaseException, line_epoch: int) -> None:
    """A connection that broke (not a timeout) means the store host is gone: no line opens
    a new connection to it (its open connections still carry what is queued on them: one
    connection's reset is not every connection's). Torch logs every failed operation of a
    TCPStore client with a C++ stack trace of some thirty frames on stderr; this keeps it
    to one per connection of ours that was open (the main line and one waiting line per
    rank set in use), not one per operation."""
    global _gone
    try:
        from torch.distributed import DistNetworkError
    except ImportError:  # an old torch
        return
    if isinstance(exc, DistNetworkError) and _gone is None and line_epoch == _epoch:
        # (a line of a replaced group failing says nothing about the current group's store)
        _gone = f"the c10d store is gone: {short(exc)}"


_op_timeout_s = 300.0  # our connections' own timeout; the caller's deadline comes first


def op_timeout_s() -> float:
    """Our connections' own timeout: at least 300 s, and the vote timeout plus 2 s."""
    return _op_timeout_s


_line: Optional[StoreLine] = None
_line_lock = threading.Lock()


_source = None  # weak reference to the default process group our lines were opened for
_resets: list = []  # what else starts anew with a new default group (``on_new_world``)


def on_new_world(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the default process group is not the one our lines were opened for
    (the host destroyed it and initialised another in this process)."""
    _resets.append(fn)


def check_world() -> None:
    """Start anew if the default process group changed since our lines were opened: the
    old store's connections, a store host known gone and every ``on_new_world`` state (the
    rounds' bookkeeping, cached vetoes) belong to the old group. Cheap (a weak-reference
    compare); never raises."""
    global _source, _line, _waiters, _gone, _epoch
    try:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:  # torch.distributed never imported: no group, nothing to check
            return
        pg = c10d._world.default_pg
        if pg is None or (_source is not None and _source() is pg):
            return
        known = weakref.ref(pg)
    except Exception:  # noqa: BLE001 - an old or odd torch: keep what we have
        return
    with _line_lock:
        if _source is not None and _source() is pg:
            return
        if _source is not None:  # a group replaced, not the first one seen: everything of
            # the old one goes before any thread can take the new group for current
            for old in [_line, *_waiters.values()]:
                if old is not None:
                    old.close()
            _line, _waiters, _gone = None, {}, None
            _epoch += 1
            for fn in list(_resets):
                fn()
        _source = known


def line(vote_timeout_s: float) -> StoreLine:
    """The process's store line (made on first use; never at import time)."""
    global _line, _op_timeout_s
    check_world()
    with _line_lock:
        _op_timeout_s = max(_op_timeout_s, float(vote_timeout_s) + 2.0)
        if _line is None:
            _line = StoreLine(_open_clone)
        return _line


_waiters: dict = {}  # rank-set key -> its waiting line


def prepare(vote_timeout_s: float, key: str) -> None:
    """Open the first line and rank set ``key``'s waiting line now (their threads and
    connections); the caller (``_prepare``) has seen a default process group. The first
    decision then finds them ready. Never raises."""
    try:
        line(vote_timeout_s).warm()
        found = waiter(vote_timeout_s, key)
        if found is not None:
            found.warm()
    except Exception:  # noqa: BLE001 - only a head start
        pass


def waiter(vote_timeout_s: float, key: str = "", line_epoch: Optional[int] = None):
    """The rank set ``key``'s own line: its rounds' operations, the blocking wait among
    them (it holds its connection while it waits, so the first line stays free for an
    abort). A rank's rounds on a set run one at a time. None for a round of a replaced
    group (``line_epoch``)."""
    global _op_timeout_s
    with _line_lock:
        if line_epoch is not None and line_epoch != _epoch:
            return None
        _op_timeout_s = max(_op_timeout_s, float(vote_timeout_s) + 2.0)
        found = _waiters.get(key)
        if found is None:
            found = _waiters[key] = StoreLine(lambda: _open_clone(strict=True))
        return found


def _after_fork_in_child():
    # the child keeps _source: a group it sets up later replaces the parent's, and then
    # everything of the parent's group (cached vetoes too) is dropped (check_world)
    global _line, _line_lock, _waiters, _gone
    _line, _waiters, _gone = None, {}, None
    _line_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def is_timeout(exc: BaseException) -> bool:
    """A store ``wait`` that ran out of time (not a connection that broke)."""
    try:
        from torch.distributed import DistNetworkError
    except ImportError:  # an old torch: only the message tells
        DistNetworkError = ()  # noqa: N806
    if DistNetworkError and isinstance(exc, DistNetworkError):
        return False
    return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()


def short(exc: BaseException) -> str:
    """An exception's first line: torch's store errors carry a C++ stack trace after it."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def plain(exc: BaseException) -> BaseException:
    """A store error as StoreUnavailable with its first line only: torch's c10d errors
    carry a C++ stack trace of some thirty frames, which would reach the host's stderr
    through our warning. Any other exception is returned as it is."""
    try:
        from torch.distributed import DistError
    except ImportError:  # an old torch
        DistError = ()  # noqa: N806
    if (DistError and isinstance(exc, DistError)) or "Exception raised from" in str(exc):
        return StoreUnavailable(f"the c10d store failed: {short(exc)}")
    return exc
