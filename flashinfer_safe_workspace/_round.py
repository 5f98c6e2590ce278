"""One decision's round in the c10d store: records, the board, and the register.

See ``_vote`` for the agreement itself (what a record says, how the register decides, why
keys cannot drift). This module is its transport over the store: which keys, when each
rank writes them, how long it waits, and who cleans up.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from . import _explain, _store, _vote
from ._vote import (ABORT, COMMIT, GRACE_S, MAGIC, PASS, REJOIN_S, Outcome, _is_yes, _loads,
                    _no_text, members_key, resolve)


class StoreRound:
    """One decision over the ranks ``ranks`` (global ranks), through the c10d store.

    Keys: ``fiws/<ranks>/<identity>/<c>/rec/<rank>``, ``…/reg`` (the register) and
    ``…/done``, where ``c`` counts this rank's rounds of that call on that rank set; and one
    board entry per rank, ``fiws/<ranks>/board/<rank>``: ``{g: generation, k: round, s:
    wait|no|done, a: arguments}``. A rank waiting for a peer whose board shows a newer
    generation at another round knows the peer is making a different call right now (a
    mismatch): it aborts both rounds at once and names both values.
    """

    def __init__(self, line: "_store.StoreLine", ranks: tuple, me: int, ident: str,
                 deadline: float, label: str, args: Optional[dict] = None):
        self.line, self.ranks, self.me, self.ident = line, tuple(ranks), me, ident
        self.deadline, self.label, self.args = deadline, label, args or {}
        self.mkey = members_key(self.ranks)
        self.rank = self.ranks[self.me]
        self.c: Optional[int] = None
        self.finished = False
        self.published = False
        self.line_timeout = 0.0  # set by the caller: the vote timeout (the waiting line's bound)
        self._aborted: dict = {}  # peer -> board generation of its round we aborted
        self._done_at: dict = {}  # peer -> when we saw it finish that round

    # -- keys
    @property
    def round_name(self) -> str:
        return f"{self.ident}/{self.c}"

    def _k(self, *parts) -> str:
        return "/".join(["fiws", self.mkey, self.ident, str(self.c), *map(str, parts)])

    def _board(self, rank) -> str:
        return f"fiws/{self.mkey}/board/{rank}"

    def _rec_keys(self):
        return [self._k("rec", r) for r in self.ranks]

    def _call(self, fn):
        # a store operation may finish a little after the round's deadline (the register
        # write at the deadline must still land); never later than GRACE_S after it
        return self.line.call(fn, self.deadline + GRACE_S)

    # -- protocol
    def open(self) -> Optional[Outcome]:
        """This rank's round for the call; an Outcome if the group decided it already."""
        start = time.monotonic()
        with _vote._meta:
            c = _vote._counters.get((self.mkey, self.ident), 0)
        for _ in range(64):  # bounded: stale commits of an earlier incarnation are skipped
            self.c = c
            reg_key = self._k("reg")
            raw = self._call(lambda s: s.get(reg_key) if s.check([reg_key]) else None)
            if raw is None:
                break
            reg = _loads(raw)
            if reg.get("o") != COMMIT:  # an abort (or all-pass) of this very call: follow it
                self._consume()
                out = Outcome(False, register=reg, followed=True, key=self._k(),
                              missing=f"decided before this rank arrived: {reg.get('why', 'abort')}",
                              elapsed_s=time.monotonic() - start)
                self._finish()
                return out
            c += 1  # a commit without our record cannot be ours (a stale key): skip it
        self._consume()
        return None

    def _consume(self):
        with _vote._meta:
            key = (self.mkey, self.ident)
            _vote._counters[key] = max(_vote._counters.get(key, 0), self.c + 1)

    def vote(self, record: dict) -> Outcome:
        start = time.monotonic()
        keys = self._rec_keys()
        mine, reg_key = self._k("rec", self.rank), self._k("reg")
        own_yes = _is_yes(record)
        with _vote._meta:
            gen = _vote._gens[self.mkey] = _vote._gens.get(self.mkey, 0) + 1
        board = json.dumps({"g": gen, "k": self.round_name, "s": "wait" if own_yes else "no",
                            "a": self.args})
        payload = json.dumps(record, sort_keys=True, default=str)
        board_key = self._board(self.rank)
        out = Outcome(False, key=self._k())
        if own_yes:
            self._call(lambda s: (s.set(board_key, board), s.set(mine, payload)))
            self.published = True
        else:  # a no needs nobody else: the abort first, then the record
            why = ("; ".join(_explain.describe(record, cand) for cand in record.get("c", {}).values())
                   or f"rank {self.rank} said no: {_no_text(record)}")
            value = json.dumps({"o": ABORT, "by": self.rank, "why": why[:500]})
            raw = self._call(lambda s: (s.compare_set(reg_key, "", value),
                                        s.set(board_key, board), s.set(mine, payload))[0])
            self.published = True
            reg = _loads(raw)
            out.commit, out.register = reg.get("o") == COMMIT, reg
            out.records = self._records_if_all(keys) or [record]
            out.verdict = resolve(out.records) if len(out.records) == len(keys) else None
            self._mismatches(record, abort_theirs=True)
            self._finish()
            out.elapsed_s = time.monotonic() - start
            return out
        try:
            self._wait(out, record, keys, reg_key, start)
        except _store.StoreTimeout:
            # the deadline passed inside a store operation (this rank was stopped, or the
            # store was slow): one last bounded try, so that a commit is never missed
            reg = self._final(f"rank {self.rank} reached its deadline")
            if reg is None:
                raise
            out.commit, out.register = reg.get("o") == COMMIT, reg
        self._finish()
        out.elapsed_s = time.monotonic() - start
        return out

    def _final(self, why: str) -> Optional[dict]:
        reg_key = self._k("reg")
        value = json.dumps({"o": ABORT, "by": self.rank, "why": str(why)[:500]})
        try:
            raw = self.line.call(lambda s: s.compare_set(reg_key, "", value),
                                 time.monotonic() + 0.4)
        except _store.StoreTimeout:
            return None
        return _loads(raw)

    def _wait(self, out, record, keys, reg_key, start) -> None:
        """Wait for the register. The rank whose record completes the set (an atomic count)
        decides for everyone; the others block on the register in the store itself, over a
        second connection, so nobody polls; a missing peer's board is looked at now and
        then, and this rank's deadline ends the wait with an abort."""
        arrived = self._k("arrived")
        if self._call(lambda s: s.add(arrived, 1)) >= len(self.ranks):
            self._decide_all(out, keys)
            return
        line = _store.waiter(self.line_timeout)
        op = self._blocking_read(line, reg_key)
        try:
            noted, board_at = [], time.monotonic() + 0.002
            while True:
                now = time.monotonic()
                if op is not None:
                    op.done.wait(max(min(_store.SLICE_S, board_at - now, self.deadline - now), 0))
                    if op.done.is_set():
                        if op.error is None and op.value is not None:
                            self._follow(out, record, keys, _loads(op.value))
                            return
                        op = None  # no waiting line, or its read timed out: poll here
                else:
                    time.sleep(max(min(0.005, board_at - now, self.deadline - now), 0))
                now = time.monotonic()
                if op is None or now >= board_at:
                    # the register (the waiting line may be busy with another thread's round)
                    # and the records (a decider that stopped after its count)
                    all_in, raw = self._call(lambda s: (
                        s.check(keys), s.get(reg_key) if s.check([reg_key]) else None))
                    if raw is not None:
                        self._follow(out, record, keys, _loads(raw))
                        return
                    if all_in:
                        self._decide_all(out, keys)
                        return
                if now >= board_at:  # is a missing peer making another call right now?
                    board_at = now + 0.05
                    waiting, finished = self._mismatches(record, abort_theirs=True)
                    noted = noted or waiting
                    if finished:  # it decided another call without us: a mismatch
                        out.records = [record] + finished
                        out.verdict = resolve(out.records)
                        reg = self._write(ABORT, "ranks called with different arguments",
                                          mismatch=finished)
                        out.commit, out.register = reg.get("o") == COMMIT, reg
                        return
                if now >= self.deadline:
                    absent = self._absent(keys)
                    out.absent = tuple(absent)
                    out.missing = (f"timed out after {now - start:.1f} s waiting for ranks "
                                   f"{absent}" if absent else "timed out")
                    reg = self._write(ABORT, out.missing)
                    out.commit, out.register = reg.get("o") == COMMIT, reg
                    if noted:  # the peers we saw making another call, for the message
                        out.records = [record] + noted
                        out.verdict = resolve(out.records)
                    return
        finally:
            _store.forget(line, op)

    def _blocking_read(self, line, reg_key):
        """A read of the register that waits in the store itself, bounded by this round's
        deadline (the op returns None when the key did not appear in time)."""
        import datetime

        until = self.deadline + GRACE_S

        def read(s):
            left = until - time.monotonic()
            if left <= 0:
                return None
            try:
                s.wait([reg_key], datetime.timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - timed out: the caller decides
                return None
            return s.get(reg_key)
        return line.submit(read)

    def _decide_all(self, out, keys) -> None:
        out.records = self._records(keys)
        out.verdict = resolve(out.records)
        wanted = COMMIT if out.verdict.commit else (PASS if out.verdict.all_pass else ABORT)
        if wanted != ABORT and time.monotonic() >= self.deadline:
            wanted = ABORT
        reg = self._write(wanted, out.verdict.why)
        out.commit, out.register = reg.get("o") == COMMIT, reg

    def _follow(self, out, record, keys, reg) -> None:
        out.commit, out.register = reg.get("o") == COMMIT, reg
        if out.commit:
            return
        if reg.get("mismatch"):
            out.records = [record] + reg["mismatch"]
            out.verdict = resolve(out.records)
            return
        records = self._records_if_all(keys)
        if records:
            out.records, out.verdict = records, resolve(records)

    def _mismatches(self, record, abort_theirs: bool) -> tuple:
        """Peers whose board shows a call newer than the last one we saw, at another round:
        ``(waiting, finished)`` pseudo-records (rank and arguments) for the message.

        A peer *waiting* elsewhere is making another call right now: its round is aborted
        (it learns at once, with both values) and its generation noted as seen, while we
        keep waiting, since its next call may be ours (it answered an earlier call from its
        veto cache or took a pass-through). A peer that *finished* another call without us
        (said no, or was decided) will not come: the caller aborts its own round."""
        peers = [r for r in self.ranks if r != self.rank]
        keys = [self._board(r) for r in peers]

        def read(s):
            with _vote._meta:
                known = dict(_vote._seen.get(self.mkey, {}))
            return known, [(_loads(s.get(k)) if s.check([k]) else None) for k in keys]
        try:
            seen, boards = self._call(read)
        except Exception:  # noqa: BLE001 - only an early exit; the deadline still holds
            return [], []
        waiting, finished = [], []
        now = time.monotonic()
        for rank, b in zip(peers, boards):
            if b and self._aborted.get(rank) == b.get("g") and b.get("s") == "done":
                # a peer whose other call we aborted has finished it: if it does not come to
                # our round soon, it was a mismatch, not a call it made before ours
                since = self._done_at.setdefault(rank, now)
                if now - since > REJOIN_S:
                    finished.append({"m": MAGIC, "rank": rank, "id": "other",
                                     "args": b.get("a", {}), "c": {}})
                continue
            if (b and rank in self._aborted and b.get("g", 0) > self._aborted[rank]
                    and b.get("k") != self.round_name):
                # it finished the call we aborted and moved on to yet another one: it is not
                # coming to ours; abort our round and leave its new one alone (we may join it)
                finished.append({"m": MAGIC, "rank": rank, "id": "other",
                                 "args": b.get("a", {}), "c": {}})
                continue
            if not b or b.get("g", 0) <= seen.get(rank, 0) or b.get("k") == self.round_name:
                continue
            ident, _, c = str(b.get("k")).rpartition("/")
            with _vote._meta:
                behind_us = _vote._counters.get((self.mkey, ident), 0) > int(c or 0)
            if behind_us:  # a round this rank already finished: old news, not a mismatch
                with _vote._meta:
                    marks = _vote._seen.setdefault(self.mkey, {})
                    marks[rank] = max(marks.get(rank, 0), b.get("g", 0))
                continue
            pseudo = {"m": MAGIC, "rank": rank, "id": "other", "args": b.get("a", {}), "c": {}}
            if b.get("s") != "wait":
                finished.append(pseudo)
                continue
            waiting.append(pseudo)
            if abort_theirs:
                their = "/".join(["fiws", self.mkey, ident, c, "reg"])
                note = json.dumps({"o": ABORT, "by": self.rank, "why": "ranks called with "
                                   "different arguments", "mismatch": [
                                       {"m": MAGIC, "rank": self.rank, "id": self.ident,
                                        "args": self.args, "c": {}}]})
                try:
                    self._call(lambda s, k=their, v=note: s.compare_set(k, "", v))
                except Exception:  # noqa: BLE001
                    pass
                with _vote._meta:
                    marks = _vote._seen.setdefault(self.mkey, {})
                    marks[rank] = max(marks.get(rank, 0), b.get("g", 0))
                self._aborted[rank] = b.get("g")
        return waiting, finished

    def _write(self, outcome: str, why: str, mismatch=None) -> dict:
        reg_key = self._k("reg")
        value = {"o": outcome, "by": self.rank, "why": str(why)[:500]}
        if mismatch:
            value["mismatch"] = mismatch
        text = json.dumps(value)
        return _loads(self._call(lambda s: s.compare_set(reg_key, "", text)))

    def _records(self, keys) -> list:
        return [_loads(v) for v in self._call(lambda s: s.multi_get(keys))]

    def _records_if_all(self, keys) -> list:
        try:
            return self._call(lambda s: [_loads(v) for v in s.multi_get(keys)]
                              if s.check(keys) else [])
        except Exception:  # noqa: BLE001 - only for the message
            return []

    def _absent(self, keys) -> list:
        try:
            present = self._call(lambda s: [s.check([k]) for k in keys])
        except Exception:  # noqa: BLE001 - only for the message
            return []
        return [r for r, here in zip(self.ranks, present) if not here]

    def _finish(self) -> None:
        """Count this rank out of the round (the last one removes the round's keys), mark
        its board entry done, and note every peer's board generation as seen. Queued on
        the store line without waiting: it runs before this rank's next operation."""
        if self.finished:
            return
        self.finished = True
        done_key, size, mkey = self._k("done"), len(self.ranks), self.mkey
        keys = self._rec_keys() + [self._k("reg"), self._k("arrived"), done_key]
        boards = [(r, self._board(r)) for r in self.ranks]
        me, published = self.rank, self.published

        def wrap_up(s):
            if published:
                raw = s.get(self._board(me)) if s.check([self._board(me)]) else None
                mine = _loads(raw) if raw is not None else None
                if mine and mine.get("k") == self.round_name:
                    mine["s"] = "done"
                    s.set(self._board(me), json.dumps(mine))
            gens = {}
            for rank, key in boards:
                if rank != me and s.check([key]):
                    gens[rank] = _loads(s.get(key)).get("g", 0)
            with _vote._meta:
                seen = _vote._seen.setdefault(mkey, {})
                for rank, g in gens.items():
                    seen[rank] = max(seen.get(rank, 0), g)
            if s.add(done_key, 1) >= size:
                for key in keys:
                    try:
                        s.delete_key(key)
                    except Exception:  # noqa: BLE001 - cleanup only
                        pass
        self.line.submit(wrap_up)

    def abort_now(self, why: str) -> None:
        """Interrupted or failed mid-round: write abort (bounded, without waiting long)."""
        if self.c is None or self.finished:
            return
        reg_key = self._k("reg")
        value = json.dumps({"o": ABORT, "by": self.rank, "why": str(why)[:500]})
        self.line.submit(lambda s: s.compare_set(reg_key, "", value)).done.wait(0.2)
        self._consume()
        self._finish()
