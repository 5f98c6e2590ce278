"""Rounds that some rank never counted out of: their keys, removed off every rank's path.

The last rank to count out of a round (``add done``) removes its N + 5 keys. A rank that
never joins (its host made another call there, it died, or its group was replaced) leaves
them behind, one round's worth per such call. A rank that counts out of a round that did
not complete, and is not the last one out, remembers it here; once the round is long
decided (its deadline on this rank plus one vote timeout and the grace: every peer still in
it has written or followed the register by then) the next count-out on this process's store
line removes it: one ``check`` of its ``done`` key, and its keys' deletes only where it is
still there (the last rank out may have removed it meanwhile). Never on a decision's path,
at most ``PER_PASS`` rounds per count-out, idempotent.

A rank arriving after the removal finds no register: it publishes, waits its own vote
timeout and vetoes, the answer it would have had (its peers answered long ago). Rounds of
a replaced group stay listed: on the same store the next group's line removes them, on
another store their ``done`` key is not found and they are dropped.
"""

from __future__ import annotations

import collections
import os
import threading
import time

PER_PASS = 8  # rounds looked at per count-out (the store line's queue stays short)
LIMIT = 4096  # rounds remembered at most; beyond, the oldest are forgotten (their keys stay)

_lock = threading.Lock()
_rounds: collections.deque = collections.deque()  # (not before (monotonic), done key, keys)


def remember(done_key: str, keys: list, not_before: float) -> None:
    """A round this rank left before every rank had counted out."""
    with _lock:
        if len(_rounds) >= LIMIT:
            _rounds.popleft()
        _rounds.append((not_before, done_key, tuple(keys)))


def pending() -> int:
    with _lock:
        return len(_rounds)


def _due(now: float) -> list:
    due = []
    with _lock:
        while _rounds and len(due) < PER_PASS and _rounds[0][0] <= now:
            due.append(_rounds.popleft())
    return due


def reap(s) -> int:
    """Remove the keys of the remembered rounds that are due, on store ``s`` (called on the
    store line, after a count-out). Returns how many rounds were still in the store."""
    removed = 0
    for _, done_key, keys in _due(time.monotonic()):
        try:
            if not s.check([done_key]):
                continue  # the last rank out removed it
            removed += 1
            for key in keys:
                s.delete_key(key)
        except Exception:  # noqa: BLE001 - cleanup only: a store that does not answer keeps them
            continue
    return removed


def _forget_all() -> None:
    global _lock
    _lock = threading.Lock()
    _rounds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)  # the child has no store of its own yet
