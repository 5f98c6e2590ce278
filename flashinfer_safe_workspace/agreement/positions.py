"""Which round a call is: its position on its rank set, under its group's generation.

FlashInfer's creation is itself a collective: a correct engine makes the same creation
calls in the same order on every rank of a group, as NCCL pairs its operations. So the
i-th call this process makes on a rank set is round i, on every rank of the set, whatever
the call is; a cached veto or a pass-through takes its position too, without a store
operation. The round's keys carry the default group's generation on its store, so nothing
of an earlier group on the same store (``init_process_group(store=...)`` again) reaches a
later one: ``fiws/<generation>/<ranks>/<position>/``.

The generation: every rank of every default group adds 1 to ``fiws/worlds`` once, when
the shim first meets the group, so the ranks of the g-th group on one store read
``g*size+1 .. g*size+size`` (docs/agreement.md: when a rank that never met a group shifts
the counts of later ones).
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from . import store as _store

WORLDS_KEY = "fiws/worlds"
LEFT = 1024  # rounds left behind remembered per rank set (beyond, the oldest keep their keys)


def prefix(generation: int, members: str, position: int) -> str:
    """The keys of one round: the same text on every rank of the round."""
    return f"{of_generation(generation)}{members}/{position}/"


def of_generation(generation: int) -> str:
    """What every key of a generation's rounds starts with."""
    return f"fiws/{generation}/"


class Group:
    """One default group in this process: its generation on the store and the next
    position of each rank set. Made anew for a new default group and after fork."""

    def __init__(self):
        self._lock = threading.Lock()
        self._turns = threading.Condition(self._lock)
        self._next: dict = {}  # rank-set key -> the position of its next call
        self._front: dict = {}  # rank-set key -> its lowest position not done yet
        self._done: dict = {}  # rank-set key -> positions done above the front
        self.generation: Optional[int] = None
        self._pending = None  # the store operation reading the generation, once submitted
        self._left: dict = {}  # rank-set key -> prefixes of rounds this rank left behind

    def take(self, set_key: str) -> int:
        """The position of this call on the rank set (every call takes one, in the order
        the calls reach the wrapper)."""
        with self._lock:
            pos = self._next.get(set_key, 0)
            self._next[set_key] = pos + 1
            return pos

    def skip(self, set_key: str) -> int:
        """A call answered without a round (a cached veto, a pass-through): its position
        is taken and done at once."""
        pos = self.take(set_key)
        self.done(set_key, pos)
        return pos

    def turn(self, set_key: str, pos: int, deadline: float) -> bool:
        """Wait (bounded) until every earlier position of the set is done here: a rank's
        rounds run in position order, so a rank that arrives at a round has answered, or
        skipped, every earlier one (``driver``'s leftovers rely on it). False at
        ``deadline``."""
        import time

        with self._turns:
            while self._front.get(set_key, 0) != pos:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._turns.wait(min(left, 0.1))
            return True

    def done(self, set_key: str, pos: int) -> None:
        with self._turns:
            finished = self._done.setdefault(set_key, set())
            finished.add(pos)
            front = self._front.get(set_key, 0)
            while front in finished:
                finished.discard(front)
                front += 1
            self._front[set_key] = front
            self._turns.notify_all()

    def remember(self, set_key: str, prefix: str) -> None:
        """A round this rank left behind (``core.leftover``); at most ``LEFT`` per set."""
        with self._lock:
            found = self._left.setdefault(set_key, [])
            if prefix not in found:
                found.append(prefix)
                del found[:-LEFT]

    def leftovers(self, set_key: Optional[str] = None) -> list:
        """The rounds left behind on a set (every set's: None)."""
        with self._lock:
            if set_key is None:
                return [p for found in self._left.values() for p in found]
            return list(self._left.get(set_key, ()))

    def forget(self, set_key: str, prefixes: list) -> None:
        with self._lock:
            self._left[set_key] = [p for p in self._left.get(set_key, ()) if p not in prefixes]

    def start_generation(self, line, size: int):
        """Submit the one ``add`` that numbers this group on its store (once); the
        store operation (``StoreLine.submit``'s), or None once the generation is known."""
        with self._lock:
            if self.generation is not None:
                return None
            if self._pending is None:
                def count(s, group=self):
                    value = int(s.add(WORLDS_KEY, 1))
                    with group._lock:
                        group.generation = (value - 1) // max(size, 1)
                    return group.generation
                self._pending = line.submit(count)
            return self._pending

    def generation_by(self, line, size: int, deadline: float) -> int:
        """The generation, read from the store if no head start did (bounded by
        ``deadline``: ``store.StoreTimeout``; a store error: ``store.StoreUnavailable``,
        and the next call tries again)."""
        op = self.start_generation(line, size)
        if op is not None:
            try:
                _store.wait_op(op, deadline)
            except _store.StoreTimeout:
                raise  # still on its way: the next call waits for the same add
            except Exception as exc:
                with self._lock:  # the add failed: the next call tries again
                    if self._pending is op:
                        self._pending = None
                raise _store.StoreUnavailable(
                    f"the group's generation could not be read: {_store.short(exc)}") from exc
        return self.generation


GROUP = Group()
_replaced: list = []  # groups replaced in this process whose leftovers are still to go


def current() -> Group:
    return GROUP


def replaced() -> list:
    """The replaced groups not handed out yet (each once): their leftovers go on the new
    group's line."""
    out = list(_replaced)
    del _replaced[: len(out)]
    return out


def _new_world():
    global GROUP
    if GROUP.leftovers():
        _replaced.append(GROUP)
    GROUP = Group()


def _after_fork():  # the child is no rank of the parent's group: it starts with nothing
    global GROUP
    GROUP = Group()
    _replaced.clear()


_store.on_new_world(_new_world)  # a new default group: its own generation and positions
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
