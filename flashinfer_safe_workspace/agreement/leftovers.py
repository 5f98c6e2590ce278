"""Rounds that some rank never counted out of: their keys, removed later.

The last rank to count out of a round (``add done``) removes its N + 5 keys. A rank that
never joins (its host made another call there, it died before publishing, or its group was
replaced) leaves them behind, one round's worth per such call. A rank that counts out of a
round that did not complete, and is not the last one out, remembers it here; once the round
is long decided (its deadline on this rank plus one vote timeout and the grace) a later
count-out on this process's store line looks at it:

* its ``done`` key gone: the last rank out removed it;
* every rank's record there: every rank is in the round and counts itself out (a rank that
  was paused after publishing too, however late): it is left to them, never taken from
  under a rank that may still read or write its register;
* else its keys are deleted, the register last: a rank that finds no register finds none of
  the round's other keys either. Such a rank (it arrives after the removal) publishes into a
  fresh round, waits and vetoes within its own vote timeout, as it would have (its peers
  answered long ago; its message may then name the peers' later calls).

At most one round per count-out (its N + 6 store operations queue on the store line ahead
of this rank's next hand-off), idempotent. Each round keeps its default group's generation
(``store.epoch``) and is only looked at in that generation, on its line: a new group
numbers its rounds from 0 again, so the same key names may be a live round of the new
group. Rounds of a replaced group are dropped unlooked-at.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Optional

PER_PASS = 1  # rounds looked at per count-out (the store line's queue stays short)
LIMIT = 4096  # rounds remembered at most; beyond, the oldest are forgotten (their keys stay)

_lock = threading.Lock()
# (not before (monotonic), the default group's generation, record keys, register key,
# the other keys, ``done`` last)
_rounds: collections.deque = collections.deque()


def remember(records: list, register: str, others: list, not_before: float,
             epoch: int) -> None:
    """A round this rank left before every rank had counted out: its record keys, its
    register key and its other keys (``done`` last); ``epoch``: the default group's
    generation the round ran in."""
    with _lock:
        if len(_rounds) >= LIMIT:
            _rounds.popleft()
        _rounds.append((not_before, epoch, tuple(records), register, tuple(others)))


def pending() -> int:
    with _lock:
        return len(_rounds)


def count_out(s, records: list, register: str, others: list, not_before: Optional[float],
              epoch: int, current: int) -> None:
    """This rank's count-out of a round, on the store line (``add`` on its ``done`` key,
    the last of ``others``): the last rank out deletes the round's keys; an earlier one
    remembers a round that did not complete (``not_before`` given) for a later removal.
    Then one earlier round left behind is looked at (``reap``)."""
    if s.add(others[-1], 1) < len(records):
        if not_before is not None:
            remember(records, register, others, not_before, epoch)
    else:
        for key in (*records, register, *others):
            try:
                s.delete_key(key)
            except Exception:  # noqa: BLE001 - cleanup only
                pass
    reap(s, epoch, current)


def _due(now: float, epoch: int) -> list:
    """Up to PER_PASS due rounds of generation ``epoch``; rounds of an earlier one are
    dropped on the way (their group was replaced)."""
    due = []
    with _lock:
        while _rounds and len(due) < PER_PASS and _rounds[0][0] <= now:
            entry = _rounds.popleft()
            if entry[1] == epoch:
                due.append(entry)
    return due


def reap(s, epoch: int, current: int) -> int:
    """Remove the remembered rounds that are due (see the module's text), on store ``s`` of
    the default group of generation ``epoch`` (called on the store line, after a count-out
    of that group); nothing while another group is current (``current``: the generation in
    place now). Returns how many rounds were removed."""
    if epoch != current:
        return 0  # a count-out of a replaced group, late on its line: not its store now
    removed = 0
    for _, _, records, register, others in _due(time.monotonic(), epoch):
        try:
            if not s.check([others[-1]]) or s.check(list(records)):
                continue  # removed by the last rank out; or every rank is in it
            for key in (*records, *others, register):  # the register last
                s.delete_key(key)
            removed += 1
        except Exception:  # noqa: BLE001 - cleanup only: a store that does not answer keeps them
            continue
    return removed


def _forget_all() -> None:
    global _lock
    _lock = threading.Lock()
    _rounds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)  # the child has no store of its own yet
