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
timeout and vetoes, the answer it would have had (its peers answered long ago). Each round
is listed with its default group's generation (``store.epoch``) and only removed in that
generation: a new group numbers its rounds from 0 again, so the same key names may be a
live round of the new group (its store is most often another one anyway). Rounds of a
replaced group are dropped unlooked-at.
"""

from __future__ import annotations

import collections
import os
import threading
import time

PER_PASS = 8  # rounds looked at per count-out (the store line's queue stays short)
LIMIT = 4096  # rounds remembered at most; beyond, the oldest are forgotten (their keys stay)

_lock = threading.Lock()
# (not before (monotonic), the default group's generation, done key, keys)
_rounds: collections.deque = collections.deque()


def remember(done_key: str, keys: list, not_before: float, epoch: int) -> None:
    """A round this rank left before every rank had counted out (``epoch``: the default
    group's generation the round ran in)."""
    with _lock:
        if len(_rounds) >= LIMIT:
            _rounds.popleft()
        _rounds.append((not_before, epoch, done_key, tuple(keys)))


def pending() -> int:
    with _lock:
        return len(_rounds)


def _due(now: float) -> list:
    due = []
    with _lock:
        while _rounds and len(due) < PER_PASS and _rounds[0][0] <= now:
            due.append(_rounds.popleft())
    return due


def reap(s, epoch: int) -> int:
    """Remove the keys of the remembered rounds that are due, on store ``s`` of the default
    group of generation ``epoch`` (called on the store line, after a count-out); a round of
    another generation is dropped. Returns how many rounds were still in the store."""
    removed = 0
    for _, their_epoch, done_key, keys in _due(time.monotonic()):
        if their_epoch != epoch:
            continue  # the same names may be a round of the group now in place
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
