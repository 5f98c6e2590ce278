"""A small exchange of values among one round's ranks through the c10d store, for a check
that needs one (the deep probe, ``checks/deep``): each rank publishes one value, reads its
peers', says when it is done, and the last one through removes the keys.

Its keys are named after the round (``fiws-x/<ranks>/<call>/<n>/<name>``), so the
ranks of one round always pair with each other: a rank that skipped an earlier round (it
arrived after that round was decided, and ran no checks) cannot shift it. Every wait is
bounded by the caller's deadline and polls the round's store line.
"""

from __future__ import annotations

import json
import time

from . import store as _store

POLL_S = 0.005


class Exchange:
    """One named exchange of one round: ``ranks`` (global ranks), this rank at ``me``."""

    def __init__(self, line, round_key: str, name: str, ranks: tuple, me: int):
        self.line, self.ranks, self.me = line, tuple(ranks), me
        self.base = f"fiws-x/{round_key}/{name}"

    def _value(self, pos) -> str:
        return f"{self.base}/v/{pos}"

    def _done(self, pos) -> str:
        return f"{self.base}/d/{pos}"

    @property
    def _count(self) -> str:
        return f"{self.base}/n"

    def keys(self) -> tuple:
        n = len(self.ranks)
        return tuple([self._value(p) for p in range(n)] + [self._done(p) for p in range(n)]
                     + [self._count])

    def peers(self) -> list:
        return [p for p in range(len(self.ranks)) if p != self.me]

    def publish(self, value: dict, deadline: float) -> None:
        key, text = self._value(self.me), json.dumps(value)
        self.line.call(lambda s: s.set(key, text), deadline)

    def gather(self, deadline: float) -> tuple:
        """``({position: value}, missing positions)``: the peers' values, once all are in
        or at ``deadline`` (then ``missing`` names the positions that never published)."""
        found = self._wait({p: self._value(p) for p in self.peers()}, deadline)
        return {p: json.loads(v) for p, v in found.items()}, [
            p for p in self.peers() if p not in found]

    def done(self, deadline: float) -> None:
        key = self._done(self.me)
        self.line.call(lambda s: s.set(key, "1"), deadline)

    def wait_done(self, positions, deadline: float) -> list:
        """The positions of ``positions`` not done by ``deadline`` (``[]``: all done)."""
        found = self._wait({p: self._done(p) for p in positions}, deadline)
        return [p for p in positions if p not in found]

    def finish(self, takers: int, deadline: float) -> None:
        """Count this rank through; the last of ``takers`` removes every key (each value
        was read before anyone counts). Best effort: a leftover key is a few bytes."""
        keys, count = self.keys(), self._count
        try:
            if self.line.call(lambda s: s.add(count, 1), deadline) >= takers:
                self.line.call(lambda s: [s.delete_key(k) for k in keys], deadline)
        except Exception:  # noqa: BLE001 - cleanup only
            pass

    def _wait(self, wanted: dict, deadline: float) -> dict:
        """``{position: value}`` of the keys in ``wanted`` present by ``deadline``."""
        names, have = list(wanted.values()), []
        while True:
            try:  # a poll cut short by the bound keeps what the last one found
                there = self.line.call(lambda s: [s.check([k]) for k in names], deadline)
                have = [p for p, ok in zip(wanted, there) if ok]
            except _store.StoreTimeout:
                pass
            if len(have) == len(wanted) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if not have:
            return {}
        keys = [wanted[p] for p in have]
        try:
            values = self.line.call(lambda s: s.multi_get(keys), deadline + 0.2)
        except _store.StoreTimeout:
            return {}
        return dict(zip(have, values))


def for_round(round_key: str, name: str, ranks: tuple, me: int, vote_timeout: float) -> Exchange:
    """The exchange ``name`` of the round ``round_key`` (``"<ranks>/<call>/<n>"``, the
    same on every rank of the round) on this process's store line."""
    return Exchange(_store.line(vote_timeout), round_key, name, ranks, me)
