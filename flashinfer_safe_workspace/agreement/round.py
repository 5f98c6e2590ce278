"""One decision's round in the c10d store: records, the board, and the register.

See ``vote`` for the agreement itself (what a record says, how the register decides, why
keys cannot drift). This module is its transport over the store: which keys, when each
rank writes them, how long it waits, and who cleans up.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Optional

from . import explain as _explain, store as _store
from .record import ABORT, COMMIT, PASS, Board, Record, Register, read_record
from .vote import GRACE_S, REJOIN_S, Outcome, members_key, resolve


class Book:
    """This process's bookkeeping of rounds, per rank set (one instance, below): the next
    round of each call, this rank's board generation, the peers' generations seen, and
    the lock that serialises this rank's decisions on a set. Only this module writes it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next: dict = {}  # (members key, call) -> this rank's next round of that call
        self._gens: dict = {}  # members key -> this rank's board generation
        self._seen: dict = {}  # members key -> {peer rank: board generation seen}
        self._set_locks: dict = {}  # members key -> lock serialising decisions on that set

    def set_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._set_locks.setdefault(key, threading.Lock())

    def next_round(self, mkey: str, call: str) -> int:
        with self._lock:
            return self._next.get((mkey, call), 0)

    def consume(self, mkey: str, call: str, c: int) -> None:
        with self._lock:
            self._next[(mkey, call)] = max(self._next.get((mkey, call), 0), c + 1)

    def new_generation(self, mkey: str) -> int:
        with self._lock:
            gen = self._gens[mkey] = self._gens.get(mkey, 0) + 1
            return gen

    def seen(self, mkey: str) -> dict:
        with self._lock:
            return dict(self._seen.get(mkey, {}))

    def mark_seen(self, mkey: str, rank: int, gen: int) -> None:
        with self._lock:
            marks = self._seen.setdefault(mkey, {})
            marks[rank] = max(marks.get(rank, 0), gen)


BOOK = Book()


def set_lock(key: str) -> threading.Lock:
    return BOOK.set_lock(key)


def _after_fork_in_child():
    global BOOK
    BOOK = Book()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
        c = BOOK.next_round(self.mkey, self.ident)
        for _ in range(64):  # bounded: stale commits of an earlier incarnation are skipped
            self.c = c
            reg_key = self._k("reg")
            raw = self._call(lambda s: s.get(reg_key) if s.check([reg_key]) else None)
            if raw is None:
                break
            reg = Register.from_json(raw)
            if not reg.commit:  # an abort (or all-pass) of this very call: follow it
                self._consume()
                out = Outcome(False, register=reg, followed=True, key=self._k(),
                              missing=f"decided before this rank arrived: {reg.why or 'abort'}",
                              elapsed_s=time.monotonic() - start)
                self._finish()
                return out
            c += 1  # a commit without our record cannot be ours (a stale key): skip it
        self._consume()
        return None

    def _consume(self):
        BOOK.consume(self.mkey, self.ident, self.c)

    def vote(self, record: Record) -> Outcome:
        start = time.monotonic()
        keys = self._rec_keys()
        mine, reg_key = self._k("rec", self.rank), self._k("reg")
        own_yes = record.is_yes()
        gen = BOOK.new_generation(self.mkey)
        board = Board(gen, self.round_name, "wait" if own_yes else "no", self.args).to_json()
        payload = record.to_json()
        board_key = self._board(self.rank)
        out = Outcome(False, key=self._k())
        if own_yes:
            self._call(lambda s: (s.set(board_key, board), s.set(mine, payload)))
            self.published = True
        else:  # a no needs nobody else: the abort first, then the record
            why = ("; ".join(_explain.describe(record, cand) for cand in record.candidates.values())
                   or f"rank {self.rank} said no: {record.no_text()}")
            value = Register(ABORT, self.rank, why, check=record.failed_check()).to_json()
            raw = self._call(lambda s: (s.compare_set(reg_key, "", value),
                                        s.set(board_key, board), s.set(mine, payload))[0])
            self.published = True
            reg = Register.from_json(raw)
            out.commit, out.register = reg.commit, reg
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
            out.commit, out.register = reg.commit, reg
        self._finish()
        out.elapsed_s = time.monotonic() - start
        return out

    def _final(self, why: str) -> Optional[Register]:
        reg_key = self._k("reg")
        value = Register(ABORT, self.rank, why).to_json()
        try:
            raw = self.line.call(lambda s: s.compare_set(reg_key, "", value),
                                 time.monotonic() + 0.4)
        except _store.StoreTimeout:
            return None
        return Register.from_json(raw)

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
                            self._follow(out, record, keys, Register.from_json(op.value))
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
                        self._follow(out, record, keys, Register.from_json(raw))
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
                        out.commit, out.register = reg.commit, reg
                        return
                if now >= self.deadline:
                    absent = self._absent(keys)
                    out.absent = tuple(absent)
                    out.missing = (f"timed out after {now - start:.1f} s waiting for ranks "
                                   f"{absent}" if absent else "timed out")
                    reg = self._write(ABORT, out.missing)
                    out.commit, out.register = reg.commit, reg
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
        reg = self._write(wanted, out.verdict.why, check=out.verdict.check)
        out.commit, out.register = reg.commit, reg

    def _follow(self, out, record, keys, reg: Register) -> None:
        out.commit, out.register = reg.commit, reg
        if out.commit:
            return
        if reg.mismatch:
            out.records = [record] + list(reg.mismatch)
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
            known = BOOK.seen(self.mkey)
            return known, [(Board.from_json(s.get(k)) if s.check([k]) else None) for k in keys]
        try:
            seen, boards = self._call(read)
        except Exception:  # noqa: BLE001 - only an early exit; the deadline still holds
            return [], []
        waiting, finished = [], []
        now = time.monotonic()
        for rank, b in zip(peers, boards):
            verdict = self._judge(rank, b, seen, now)
            if verdict is None:
                continue
            stand_in = Record.stand_in(rank, "other", b.args)
            if verdict == "finished":
                finished.append(stand_in)
                continue
            waiting.append(stand_in)
            if abort_theirs:
                self._abort_theirs(rank, b)
        return waiting, finished

    def _judge(self, rank: int, b: Optional[Board], seen: dict, now: float) -> Optional[str]:
        """What a peer's board entry says about our round: ``"waiting"`` (it waits on
        another call now), ``"finished"`` (it decided another call without us), or None."""
        if b is None:
            return None
        if self._aborted.get(rank) == b.generation and b.state == "done":
            # a peer whose other call we aborted has finished it: if it does not come to
            # our round soon, it was a mismatch, not a call it made before ours
            since = self._done_at.setdefault(rank, now)
            return "finished" if now - since > REJOIN_S else None
        if (rank in self._aborted and b.generation > self._aborted[rank]
                and b.round != self.round_name):
            # it finished the call we aborted and moved on to yet another one: it is not
            # coming to ours; abort our round and leave its new one alone (we may join it)
            return "finished"
        if b.generation <= seen.get(rank, 0) or b.round == self.round_name:
            return None
        call, _, c = b.round.rpartition("/")
        if BOOK.next_round(self.mkey, call) > int(c or 0):
            # a round this rank already finished: old news, not a mismatch
            BOOK.mark_seen(self.mkey, rank, b.generation)
            return None
        return "waiting" if b.state == "wait" else "finished"

    def _abort_theirs(self, rank: int, b: Board) -> None:
        """Abort a peer's round of another call (it learns at once, with both values)."""
        call, _, c = b.round.rpartition("/")
        their = "/".join(["fiws", self.mkey, call, c, "reg"])
        note = Register(ABORT, self.rank, "ranks called with different arguments",
                        mismatch=(Record.stand_in(self.rank, self.ident, self.args),)).to_json()
        try:
            self._call(lambda s: s.compare_set(their, "", note))
        except Exception:  # noqa: BLE001 - only an early exit; its deadline still holds
            pass
        BOOK.mark_seen(self.mkey, rank, b.generation)
        self._aborted[rank] = b.generation

    def _write(self, outcome: str, why: str, mismatch=(), check: str = "") -> Register:
        reg_key = self._k("reg")
        text = Register(outcome, self.rank, why, tuple(mismatch), check=check).to_json()
        return Register.from_json(self._call(lambda s: s.compare_set(reg_key, "", text)))

    def _records(self, keys) -> list:
        return [read_record(v) for v in self._call(lambda s: s.multi_get(keys))]

    def _records_if_all(self, keys) -> list:
        try:
            return self._call(lambda s: [read_record(v) for v in s.multi_get(keys)]
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
                mine = Board.from_json(raw) if raw is not None else None
                if mine is not None and mine.round == self.round_name:
                    s.set(self._board(me), dataclasses.replace(mine, state="done").to_json())
            for rank, key in boards:
                if rank != me and s.check([key]):
                    peer = Board.from_json(s.get(key))
                    if peer is not None:
                        BOOK.mark_seen(mkey, rank, peer.generation)
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
        value = Register(ABORT, self.rank, why).to_json()
        self.line.submit(lambda s: s.compare_set(reg_key, "", value)).done.wait(0.2)
        self._consume()
        self._finish()
