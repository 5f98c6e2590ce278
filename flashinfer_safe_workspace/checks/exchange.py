"""The deep probe's exchange (``deep``) among one round's ranks through the c10d store, before
the vote: each rank publishes one
value, reads its peers', says when it is done, and the last one through removes the keys.

Its keys are under the round's own prefix (``fiws/<generation>/<ranks>/<position>/x/
<name>/``), so the ranks of one round always pair. It is bounded by the round: every wait
ends at ``until`` (the round's deadline less the time the vote needs), or as soon as the
round's register is written (a peer said no, or gave up): then ``stopped`` says so, and the
vote that follows reads that register. Waits poll with ``check``, which wakes nobody.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from ..agreement import store as _store

POLL_S = 0.005
GRACE_S = 0.2  # one operation past the bound (the first look at a bound already passed)


class Exchange:
    """One named exchange of one round: ``ranks`` (global ranks), this rank at ``me``."""

    def __init__(self, line, prefix: str, name: str, ranks: tuple, me: int, until: float):
        self.line, self.ranks, self.me, self.until = line, tuple(ranks), me, until
        self.base = f"{prefix}x/{name}"
        self.register = f"{prefix}d"
        self.stopped = ""  # why a wait ended early: "decided" (the register is written)

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

    def _bound(self) -> float:
        """Where one operation gives up: the exchange's bound, or a little after now when
        that has passed (one try is always made, however late)."""
        return max(self.until, time.monotonic()) + GRACE_S

    def decided(self) -> bool:
        """Whether the round's register is written (one ``check``)."""
        key = self.register
        try:
            return bool(self.line.call(lambda s: s.check([key]), self._bound()))
        except Exception:  # noqa: BLE001 - not known: the bound still holds
            return False

    def publish(self, value: dict) -> None:
        key, text = self._value(self.me), json.dumps(value)
        self.line.call(lambda s: s.set(key, text), self._bound())

    def gather(self) -> tuple:
        """``({position: value}, missing positions)``: the peers' values, once all are in,
        or at the bound (``missing`` names the positions that never published)."""
        found = self._wait({p: self._value(p) for p in self.peers()})
        return {p: json.loads(v) for p, v in found.items()}, [
            p for p in self.peers() if p not in found]

    def done(self) -> None:
        key = self._done(self.me)
        self.line.call(lambda s: s.set(key, "1"), self._bound())

    def wait_done(self, positions) -> list:
        """The positions of ``positions`` not done by the bound (``[]``: all done)."""
        found = self._wait({p: self._done(p) for p in positions})
        return [p for p in positions if p not in found]

    def finish(self, takers: int) -> None:
        """Count this rank through; the last of ``takers`` removes every key (each value
        was read before anyone counts). Best effort: a leftover key is a few bytes."""
        keys, count = self.keys(), self._count
        try:
            if self.line.call(lambda s: s.add(count, 1), self._bound()) >= takers:
                self.line.call(lambda s: [s.delete_key(k) for k in keys], self._bound())
        except Exception:  # noqa: BLE001 - cleanup only
            pass

    def _wait(self, wanted: dict) -> dict:
        """``{position: value}`` of the keys in ``wanted`` present by the bound, or when
        the round's register is written."""
        names, have, register = list(wanted.values()), [], self.register
        while True:
            try:  # a poll cut short by the bound keeps what the last one found (one look
                # is always taken, however late)
                there, decided = self.line.call(
                    lambda s: ([s.check([k]) for k in names], s.check([register])), self._bound())
                have = [p for p, ok in zip(wanted, there) if ok]
            except _store.StoreTimeout:
                decided = False
            if len(have) == len(wanted):
                break
            if decided:
                self.stopped = "decided"
                break
            if time.monotonic() >= self.until:
                break
            time.sleep(POLL_S)
        if not have:
            return {}
        keys = [wanted[p] for p in have]
        try:
            values = self.line.call(lambda s: s.multi_get(keys), self._bound())
        except _store.StoreTimeout:
            return {}
        return dict(zip(have, values))


def for_round(prefix: str, name: str, ranks: tuple, me: int, vote_timeout: float,
              until: float) -> Optional[Exchange]:
    """The exchange ``name`` of the round with key prefix ``prefix`` on this process's
    store line, bounded by ``until``."""
    return Exchange(_store.line(vote_timeout), prefix, name, ranks, me, until)
