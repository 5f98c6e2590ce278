"""Runs one rank's ``core.Core`` on the c10d store: its operations on our store lines, the
replies back into it, the real clock against its deadline. The core decides; this carries.

Two lines (``store``): the rank set's own line runs the round's operations, in the order
the core emits them, its blocking wait among them, and hands each reply to the core there
(under the decision's lock): one hand-off per decision, whatever N. The process's main
line carries the abort at a deadline or an interrupt, which must not queue behind that
wait. The calling thread only waits, in slices, and tells the core the time. After the
answer the count-out runs on the round's line while the caller goes on. Rounds this rank
left behind (``core.leftover``) go once it answers a later round of the set from the
count's completer (``core.sweep``), or when the default group is replaced. Without a
waiting line (a store that cannot be cloned, or a waiting line that failed), the wait is
a ``check`` every ``POLL_S`` on the main line.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Optional

from .. import _points, _reasons as _rec
from . import core as _core, explain as _explain, positions as _positions, store as _store
from .record import Record, Register
from .vote import GRACE_S, Outcome, codec_for, members_key

POLL_S = 0.005  # a wait without a waiting line: one check this often
STOPPED_S = 0.25  # a slice that took this much longer: the process was stopped (core.on_resume)
RAN_S = 0.05  # what a slice counts as running time at least, however late it ended
ABSENT = "\x00fiws:absent"  # never a value of ours: a compare_set with it only reads


class StoreVote:
    """One rank's vote in one round of a rank set through the c10d store."""

    def __init__(self, ranks: tuple, me: int, ident: str, deadline: float, vote_timeout: float,
                 position: int, label: str = "", args: Optional[dict] = None, *,
                 lines: Optional[dict] = None, group=None, size: Optional[int] = None):
        """``lines`` (``{"main": StoreLine, "wait": StoreLine or absent}``), ``group`` (a
        ``positions.Group``) and ``size`` (the default group's size, for its generation)
        default to this process's default group."""
        self.ranks, self.me, self.ident, self.label = tuple(ranks), me, ident, label
        self.rank = self.ranks[me]
        self.deadline, self.vote_timeout, self.position = deadline, vote_timeout, position
        self.grace = GRACE_S  # how long an operation past the deadline may take (abort, reads)
        self.args = args or {}
        self.mkey = members_key(self.ranks)
        self.epoch = _store.epoch()
        self.group = group if group is not None else _positions.current()
        self._given, self._size = lines, size
        self.prefix = ""  # "fiws/<generation>/<ranks>/<position>/", once open
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._core: Optional[_core.Core] = None
        self._queues = {"main": collections.deque(), "wait": collections.deque()}
        self._active = {"main": False, "wait": False}
        self._error: Optional[BaseException] = None
        self._lines: dict = {}
        self._polled: Optional[_core.Op] = None  # a wait done by polling (no waiting line)
        self._abort_failed = False  # its abort's connection failed: a register read answers

    # -- before the record

    def open(self) -> None:
        """Name the round (the group's generation: read once per group) and connect the
        lines while this rank plans and probes."""
        if self._given is not None:
            self._lines = dict(self._given)
        else:
            self._lines["main"] = _store.line(self.vote_timeout)
            waiting = _store.waiter(self.vote_timeout, self.mkey, self.epoch)
            if waiting is not None:
                self._lines["wait"] = waiting
        if "wait" in self._lines:
            self._lines["wait"].warm()
        main = self._lines["main"]
        size = self._size if self._size is not None else _group_size()
        generation = self.group.generation_by(main, size, self.deadline + self.grace)
        # (a store that does not answer vetoes as STORE_ERROR after the grace, as in a round)
        for old in _positions.replaced():
            forget_group(old, main, generation)
        self.prefix = _positions.prefix(generation, self.mkey, self.position)

    # -- the vote

    def vote(self, record: Record) -> Outcome:
        start = time.monotonic()
        yes = record.is_yes()
        self._seen: dict = {}
        codec = codec_for(self.rank, record.call, self._seen)
        setup = _core.Setup(self.prefix, len(self.ranks), self.me, yes, record.call,
                            record.to_json(), self.deadline, self.grace,
                            _texts(record, self.rank, self.vote_timeout, yes), codec)
        with self._lock:
            core, ops = _core.Core(setup).start()
            self._apply(core, ops)
        self._wait()
        core = self._core
        out = self._outcome(core, record)
        out.elapsed_s = time.monotonic() - start
        _points.hit("round.voted")
        return out

    def abort_now(self, why: str) -> None:
        """Interrupted (or our own error) before or during the vote: this rank's abort is
        written (bounded: the caller does not wait for the answer)."""
        if not self.prefix:
            return
        with self._lock:
            core = self._core
            if core is None:  # before its record: the abort alone, no record
                text = _explain.interrupted(self.rank, why, self.ident).to_text()
                key = self.prefix + "d"
                self._lines["main"].submit(lambda s: s.compare_set(key, "", text)).done.wait(0.2)
                return
            core, ops = core.on_interrupt(time.monotonic())
            self._apply(core, ops)
        deadline = time.monotonic() + 0.2
        while self._queues["main"] and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- running the core

    def _apply(self, core: _core.Core, ops: list) -> None:
        """The core's next state and its operations (the lock is held)."""
        before = self._core
        self._core = core
        if core.answer is not None:
            if before is None or before.answer is None:
                ops = list(ops) + self._answered(core)
            self._done.set()
        if before is not None and not _core.leftover(before) and _core.leftover(core):
            self.group.remember(self.mkey, self.prefix)
        for op in ops:
            line = op.line if op.line in self._lines else "main"
            if op.kind == "wait" and "wait" not in self._lines:
                self._polled = op  # the calling thread looks for the key
                continue
            self._queues[line].append(op)
        for name, queue in self._queues.items():
            if queue and not self._active[name]:
                self._active[name] = True
                self._lines[name].submit(lambda s, n=name: self._drain(s, n),
                                         failed=lambda exc, n=name: self._failed(n, None, exc))

    def _answered(self, core: _core.Core) -> list:
        """Once answered: the rounds this rank left behind on the set go when this answer
        shows every rank came (``core.sweep``)."""
        older = [p for p in self.group.leftovers(self.mkey) if p != self.prefix]
        gone = _core.sweep(core, older)
        if gone:
            self.group.forget(self.mkey, older)
        return gone

    def _drain(self, s, name: str) -> None:
        """On a line's thread: run the queued operations in order, each reply to the core."""
        while True:
            with self._lock:
                queue = self._queues[name]
                if not queue:
                    self._active[name] = False
                    return
                op = queue.popleft()
            if op.tag == _core.T_ABORT:
                _points.hit("round.abort_sending")
            try:
                value = _execute(s, op)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._failed(name, op, exc)
                raise
            if op.tag == _core.T_COUNT:
                _points.hit("round.published")  # its record is in and it counted itself in
            elif op.tag in (_core.T_WRITE, _core.T_FETCH):
                _points.hit("round.before_register")  # the register's answer is on its way
            if op.tag:
                with self._lock:
                    self._apply(*self._core.on_reply(op.tag, value))
                    if self._abort_failed and self._core.answer is None and \
                            self._core.read is not None:  # its abort failed: what it read
                        self._apply(*self._core.on_error())  # is final
                        self._error = None

    def _failed(self, name: str, op: Optional[_core.Op], exc: BaseException) -> None:
        """A store operation failed on line ``name``. The waiting line's failure moves its
        operations to the main line (a wait becomes polling). The main line's failure
        answers from the register read meanwhile; failing this rank's abort while its
        waiting line still waits, it leaves the answer to that line until the abort's grace
        has passed (a connection reset is not the register's answer); else in doubt.
        ``op`` is None when the line could not connect (nothing of its queue ran)."""
        with self._lock:
            queue = self._queues[name]
            queue_head = queue[0] if queue else None
            if name == "wait" and self._core is not None and self._core.answer is None:
                rest = ([op] if op is not None else []) + list(queue)
                queue.clear()
                self._active[name] = False
                del self._lines["wait"]
                self._apply(self._core, rest)
                return
            queue.clear()
            self._active[name] = False
            if self._core is None:  # before its record (a clean-up, a connection)
                return
            if op is None and queue_head is not None:  # could not connect: what it held
                op = queue_head
            if self._error is None and self._core.answer is None:
                self._error = exc
            if self._core.answer is None and self._core.read is not None:
                self._apply(*self._core.on_error())  # it read the register already
                self._error = None
            elif self._core.answer is None and op is not None and op.tag == _core.T_ABORT \
                    and self._active.get("wait") and "wait" in self._lines:
                self._abort_failed = True  # its waiting line may still read the register (a
                return  # peer's write, or this abort's if it got through) until the grace
            self._done.set()

    def _wait(self) -> None:
        """The calling thread: wait for the answer in slices; tell the core the time at
        its deadline and after the grace; poll a wait without a waiting line (a poll
        bounded by ``SLICE_S``, inside its slice). Each slice is timed from the end of the
        one before (the slices tile the time: a stop anywhere in the loop falls in one of
        them); a slice longer than asked by more than ``STOPPED_S`` means this process ran
        nothing meanwhile, and the core is told how long, less ``RAN_S``
        (``Core.on_resume``), whatever the slice before. After a resumption the core is
        told the time only after a slice of at least ``RAN_S`` more, so that replies
        waiting since the stop are read first (the slice after that ticks, stopped or
        not). Each slice so counts at least ``RAN_S`` of running time, and a process
        starved in every slice is in doubt after at most twice grace / ``RAN_S`` slices."""
        try:
            last, resumed = time.monotonic(), False
            while not self._done.is_set():
                with self._lock:
                    wake = self._core.wake_at()
                pause = _store.SLICE_S if self._polled is None else POLL_S
                if wake is not None:
                    pause = min(pause, max(wake - time.monotonic(), 0.0))
                if resumed:
                    pause = max(pause, RAN_S)
                self._done.wait(pause)
                asked = pause
                if self._polled is not None and not self._done.is_set():
                    self._poll()
                    asked += _store.SLICE_S  # what the poll may take (its bound)
                now = time.monotonic()
                lost, last = now - last - asked, now
                if self._done.is_set():
                    break
                with self._lock:
                    if lost > STOPPED_S:  # a stop: always credited (less RAN_S)
                        self._apply(*self._core.on_resume(now, lost - RAN_S))
                        if not resumed:
                            resumed = True
                            continue  # the replies that came meanwhile first
                    resumed = False
                    if wake is not None and now >= wake:
                        self._apply(*self._core.on_tick(now))
        except BaseException:
            self.abort_now("interrupted")
            raise

    def _poll(self) -> None:
        op = self._polled
        try:
            there = self._lines["main"].call(lambda s: s.check([op.key]),
                                             time.monotonic() + _store.SLICE_S)
        except _store.StoreTimeout:
            return
        except Exception as exc:  # noqa: BLE001 - the store failed: in doubt
            with self._lock:
                self._error = self._error or exc
                self._done.set()
            return
        if there:
            with self._lock:
                self._polled = None
                self._apply(*self._core.on_reply(op.tag, None))

    # -- the answer

    def _outcome(self, core: _core.Core, record: Record) -> Outcome:
        if core.answer is None or core.answer == _core.DOUBT:
            why = (f"the c10d store did not answer in time ({_store.short(self._error)})"
                   if self._error is not None else
                   "the c10d store did not answer this rank's last write in time")
            return Outcome(False, missing=why, in_doubt=True, key=self.prefix)
        reg = Register.from_text(core.register)
        out = Outcome(reg.commit, register=reg, key=self.prefix)
        if self._seen and not reg.commit:  # it completed the count and read every record
            records = self._seen.get("records", [])
            if records and all(r is not None for r in records):
                out.records, out.verdict = records, self._seen.get("verdict")
        if not reg.commit and core.decider and core.proposed and \
                core.register == core.setup.texts[1]:
            absent = self._absent(reg.by)  # its own deadline decided: who never came
            waited = time.monotonic() - (self.deadline - self.vote_timeout)
            out.absent = tuple(absent)
            out.missing = (f"timed out after {waited:.1f} s waiting for ranks {absent}"
                           if absent else "timed out")
        elif not reg.commit and not reg.complete and not reg.details and reg.by != self.rank \
                and _rec.ABSENT in reg.reasons:  # another rank's deadline decided: who is
            absent = self._absent(reg.by)  # still not in (none: they came after it)
            if absent:
                out.absent = tuple(absent)
                out.missing = f"{reg.why}; ranks {absent} had not voted"
        return out

    def _absent(self, by) -> list:
        """The ranks whose record is not in the round, less this rank and ``by`` (the
        register's writer), which both came (for the message only; [] when not known)."""
        r, d = self.prefix + "r", self.prefix + "d"
        try:
            raw, reg = self._lines["main"].call(lambda s: (_get_if(s, r), _get_if(s, d)),
                                                time.monotonic() + self.grace / 2)
        except Exception:  # noqa: BLE001 - only for the message
            return []
        if reg is None:  # the round's keys went (every rank counted out): not known
            return []
        there = _core.arrived(raw or b"")
        return [k for i, k in enumerate(self.ranks) if i not in there and k not in (self.rank, by)]


def post_skip(ranks: tuple, me: int, ident: str, position: int, text: str, vote_timeout: float,
              group=None) -> None:
    """A call this rank answers from its veto cache: the abort ``text`` goes into the round
    at ``position`` and this rank counts out (``core.Core.skip``), without waiting. Nothing
    when the group's generation is not known (no round of it has run here)."""
    group = group if group is not None else _positions.current()
    if group.generation is None:
        return
    v = StoreVote(ranks, me, ident, time.monotonic() + vote_timeout, vote_timeout, position,
                  group=group)
    v.prefix = _positions.prefix(group.generation, v.mkey, position)
    v._lines["main"] = _store.line(vote_timeout)
    setup = _core.Setup(v.prefix, len(v.ranks), me, False, ident, "", v.deadline, v.grace,
                        (text, text, text), codec_for(v.rank, ident))
    with v._lock:
        v._apply(*_core.Core(setup).skip())


_TEXTS: dict = {}  # (rank, vote timeout, call) -> the abort texts of a deadline, an interrupt


def _texts(record: Record, rank: int, vote_timeout: float, yes: bool) -> tuple:
    """The abort texts the core may write (``core.Setup.texts``): this rank's no (only
    built when it says no), its deadline's, an interrupt's (the same for every call of a
    kind: kept)."""
    key = (rank, vote_timeout, record.call)
    fixed = _TEXTS.get(key)
    if fixed is None:
        if len(_TEXTS) > 256:
            _TEXTS.clear()
        fixed = _TEXTS[key] = (
            _explain.timed_out(rank, vote_timeout, record.call).to_text(),
            _explain.interrupted(rank, "interrupted", record.call).to_text())
    return ("" if yes else _explain.said_no(record).to_text(),) + fixed


# --------------------------------------------------------------------------- the store


def _execute(s, op: _core.Op, until: Optional[float] = None):
    """One core operation on store ``s`` (our own connection). A ``wait`` is bounded by
    ``until`` (by default our connections' own timeout, ``store.op_timeout_s``)."""
    kind = op.kind
    if kind == "append":
        s.append(op.key, op.value)
        return None
    if kind == "add":
        return int(s.add(op.key, op.n))
    if kind == "cas":
        return s.compare_set(op.key, "", op.value)
    if kind == "get":
        return _get_if(s, op.key)
    if kind == "check":
        return bool(s.check([op.key]))
    if kind == "wait":
        # the store wakes it when the register is written: by a peer, or by this rank's
        # own abort at its deadline, on the main line (which reaches the store when it
        # answers again, however late). Its own bound is our connections' timeout, so
        # torch's "waitForInput ... timed out" shows only when the store does not answer
        # for that long (docs/agreement.md)
        if until is None:
            until = time.monotonic() + _store.op_timeout_s()
        left = max(until - time.monotonic(), 0.001)
        try:
            s.wait([op.key], datetime.timedelta(seconds=left))
        except Exception as exc:  # noqa: BLE001 - a wait that ran out reads as a wake-up
            if not _store.is_timeout(exc):
                raise
        return None
    if kind == "delete":
        return s.delete_key(op.key)
    raise ValueError(f"unknown store operation {kind!r}")


def _get_if(s, key: str):
    """``key``'s value, or None when it is not there, in one operation that writes
    nothing: a ``compare_set`` expecting a value we never write (the store answers the
    value it holds, or the expected one for a missing key)."""
    raw = s.compare_set(key, ABSENT, ABSENT)
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    return None if text == ABSENT else raw


def _group_size() -> int:
    from . import group as _group
    return _group.world_size()


def forget_group(old, line, generation: Optional[int] = None) -> None:
    """The default group ``old`` was replaced: the rounds it left behind go, on ``line``
    (the new group's; without waiting), but for those of the new group's own
    ``generation``: on the same store a new group's generation is a later one, so a
    leftover with the same number is the new group's own round on a new store, whose
    counts start again (deleting it under a peer's feet lost that round: both ranks waited
    out the vote timeout). Never raises."""
    try:
        keep = None if generation is None else _positions.of_generation(generation)
        ops = _core.forget([p for p in old.leftovers()
                            if keep is None or not p.startswith(keep)])
        if ops:
            line.submit(lambda s: [s.delete_key(op.key) for op in ops])
    except Exception:  # noqa: BLE001 - clean-up only
        pass
