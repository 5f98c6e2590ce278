"""What a round runs on the store thread, and how its caller waits for a blocking step.

The functions taking ``s`` run on one of our store lines' worker threads (``store``), with
``s`` our own connection; ``await_op`` runs on the caller's thread and waits for such a
step in slices, with a bounded poll on the first line as its fallback.
"""

from __future__ import annotations

import datetime
import time

from .record import read_record
from .store import SLICE_S, forget, is_timeout, op_timeout_s


def text(raw) -> str:
    """A store value as text."""
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw).decode(errors="replace")
    return "" if raw is None else str(raw)


def multi_set(s, keys: list, values: list) -> None:
    if hasattr(s, "multi_set"):
        s.multi_set(keys, values)
    else:
        for key, value in zip(keys, values):
            s.set(key, value)


ABSENT = "\x00fiws:absent"  # never a value of ours: compare_set with it only reads


def get_if(s, key: str):
    """``key``'s value, or None when it is not there, in one store operation: a
    ``compare_set`` that expects ``ABSENT`` and would write ``ABSENT`` (the store answers
    the value it holds, or the expected value for a missing key, and writes nothing).
    Never the store's blocking ``get`` here (a round's keys go once its last rank is out,
    which may be while a rank that gave up still runs its steps)."""
    raw = s.compare_set(key, ABSENT, ABSENT)
    return None if text(raw) == ABSENT else raw


def wait_get(s, key: str, until: float):
    """Wait in the store until ``key`` exists and read it, in one operation: the store's
    ``get`` on our own waiting line, its timeout set to what is left until ``until``.
    None when ``until`` passed first; a broken connection raises. The store also wakes a
    waiting ``get`` when another client reads the missing key with ``compare_set``
    (``get_if``) or deletes it: the answer is then empty, and the wait goes on. A store
    whose timeout cannot be set waits with ``wait_key`` and reads with ``get_if``."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return None
        try:
            s.set_timeout(datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - a store without set_timeout: wait, then read
            if not wait_key(s, key, until):
                return None
            raw = get_if(s, key) or b""
        else:
            raw = _blocking_get(s, key)
        if raw is None or len(raw):
            return raw
        time.sleep(0.001)  # woken without a value: wait again


def _blocking_get(s, key: str):
    try:
        return s.get(key)
    except Exception as exc:  # noqa: BLE001 - a timeout reads as None
        if is_timeout(exc):
            return None
        raise
    finally:  # the line's other operations keep the connection's own timeout
        try:
            s.set_timeout(datetime.timedelta(seconds=op_timeout_s()))
        except Exception:  # noqa: BLE001
            pass


def wait_key(s, key: str, until: float) -> bool:
    """Wait in the store until ``key`` exists: False when ``until`` passed first; a broken
    connection raises (the caller then polls on its first line)."""
    left = until - time.monotonic()
    if left <= 0:
        return False
    try:
        s.wait([key], datetime.timedelta(seconds=left))
    except Exception as exc:  # noqa: BLE001 - a timeout reads as False
        if is_timeout(exc):
            return False
        raise
    return True


def records_if_all(call_store, keys) -> list:
    """Every record of a round, or [] when one is missing (for a message only)."""
    try:
        return call_store(lambda s: [read_record(v) for v in s.multi_get(keys)]
                          if s.check(keys) else [])
    except Exception:  # noqa: BLE001 - only for the message
        return []


def absent(call_store, ranks, keys) -> list:
    """The ranks whose record is missing (for a message only)."""
    try:
        present = call_store(lambda s: [s.check([k]) for k in keys])
    except Exception:  # noqa: BLE001 - only for the message
        return []
    return [r for r, here in zip(ranks, present) if not here]


POLL_S = 0.005  # only without a waiting line (a store without clone())


def await_op(line_, steps, poll, until: float, tick=None, tick_after: float = 0.05,
             tick_every: float = 0.1) -> tuple:
    """Run ``steps(store)`` on ``line_`` (a waiting line: it blocks in the store) and wait
    for it in slices: ``("op", its value)``; ``("tick", x)`` when ``tick()`` (run from
    ``tick_after`` on, every ``tick_every``) returns x; ``(None, None)`` when ``until``
    passes first. When the line fails, ``poll()`` (a bounded read on the first line) is
    called instead until it returns a value: ``("poll", its value)``."""
    op = line_.submit(steps) if line_ is not None else None
    next_tick = time.monotonic() + tick_after
    try:
        while True:
            now = time.monotonic()
            if now >= until:
                return None, None
            wake = min(until, next_tick) if tick is not None else until
            if op is not None:
                op.done.wait(max(min(SLICE_S, wake - now), 0))
                if op.done.is_set():
                    if op.error is None:
                        return "op", op.value
                    op = None  # the waiting line failed: poll on the first line
            else:
                time.sleep(max(min(POLL_S, wake - now), 0))
                raw = poll()
                if raw is not None:
                    return "poll", raw
            now = time.monotonic()
            if now < next_tick:
                continue
            next_tick = now + tick_every
            if op is not None and not op.started:  # the line is held by another read
                raw = poll()
                # act on the poll only if the op can no longer run: had it started during
                # the poll, it would do the same step (an acknowledgement) a second time
                if raw is not None and line_.cancel(op):
                    return "poll", raw
            found = tick() if tick is not None else None
            if found is not None:
                return "tick", found
    finally:
        forget(line_, op)
