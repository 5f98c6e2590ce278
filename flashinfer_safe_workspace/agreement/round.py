"""One decision's round in the c10d store: records, the proposal, acknowledgements and the
register (the peers' boards are read through ``board``).

See ``vote`` for the agreement itself (what a record says, how the register decides, why
keys cannot drift). This module is its transport over the store: which keys, when each
rank writes them, how long it waits, and who cleans up.

Store operations per rank per decision on the healthy path (all yes), whatever N:
first line, one hand-off: read the register (``get_if``, one ``compare_set`` that writes
nothing: a round decided before we came is followed, a stale commit skipped), publish
record and board (``multi_set``), count in (``add``); the count that completes the set
reads every record (``multi_get``) = 3, or 4. Waiting line, one hand-off: that rank
proposes (``compare_set ready``) and waits for the register and reads it in one blocking
``get`` = 2; every other rank waits for ``ready`` and reads it (one ``get``), acknowledges
(``add``), then completes the count and writes ``commit`` (``compare_set``) or waits for
the register (``get``) = 3. After the answer, queued without waiting: count out (``add
done``) = 1; the last rank out deletes the round's N + 5 keys, off every rank's path (a
round some rank never counts out of: ``leftovers``).
Total 7 per rank in 2 hand-offs (+ 1 after), against 12-14 in 4-5 at 714be8f.

A yes counts only from a rank still alive after every record was in: a rank that dies
before acknowledging leaves the register to the deadline's abort. Every wait in the store
is bounded by what is left of the round. Boards are read only on the slow path (a round
still open after ``BOARD_AFTER_S``), with one ``multi_get``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from .. import _points
from .._reasons import ARG_MISMATCH
from . import board as _board, explain as _explain, leftovers as _leftovers, ops as _ops
from . import store as _store
from .board import BOARD_AFTER_S, BOARD_EVERY_S
from .record import ABORT, COMMIT, PASS, PROPOSE, WAKE, Board, Record, Register, read_record
from .vote import GRACE_S, Outcome, members_key, resolve


class StoreRound:
    """One decision over the ranks ``ranks`` (global ranks), through the c10d store. Keys
    ``fiws/<ranks>/<identity>/<c>/`` + ``rec/<rank>``, ``arrived``, ``ready`` (``propose``
    or ``wake``, written once), ``acks``, ``reg`` (the register), ``done``; ``c`` counts
    this rank's rounds of the call on the set. Board entries: ``board``."""

    def __init__(self, line: "_store.StoreLine", ranks: tuple, me: int, ident: str,
                 deadline: float, label: str, args: Optional[dict] = None):
        self.line, self.ranks, self.me, self.ident = line, tuple(ranks), me, ident
        self.deadline, self.label, self.args = deadline, label, args or {}
        self.mkey = members_key(self.ranks)
        self.rank = self.ranks[self.me]
        self.c: Optional[int] = None
        self.finished = False
        self.published = False
        self.complete = False  # every record was in and said yes: no board needs a look
        self.acked = False  # this rank counted itself into ``acks`` (at most once)
        self.line_timeout = 0.0  # set by the caller: the vote timeout (the waiting line's bound)
        self._entry: Optional[Board] = None  # this rank's board entry for this round
        self.calls, self._opened = 0, time.monotonic()  # calls on the set, this one included
        # this round's group: its bookkeeping and its lines, also when a new default group
        # replaces it while the round runs (``store.check_world``)
        self.book, self.epoch = _board.BOOK, _store.epoch()
        self._watch = _board.Watch(self)

    # -- keys
    @property
    def round_name(self) -> str:
        return f"{self.ident}/{self.c}"

    def _k(self, *parts) -> str:
        return "/".join(["fiws", self.mkey, self.ident, str(self.c), *map(str, parts)])

    def _board_key(self, rank) -> str:
        return _board.board_key(self.mkey, rank)

    def _rec_keys(self):
        return [self._k("rec", r) for r in self.ranks]

    def call_store(self, fn):
        """``fn(store)`` on the store line. It may finish a little after the round's deadline
        (the register write at the deadline must still land); never later than GRACE_S."""
        return self.line.call(fn, self.deadline + GRACE_S)

    # -- protocol
    def open(self) -> Optional[Outcome]:
        """This rank's round for the call: no store operation (``vote`` reads the register
        in the hand-off that publishes). None: the round is not known decided."""
        self.calls = self.book.count_call(self.mkey)
        _board.world_of(self.line, self.book, self.deadline + GRACE_S)  # once per group
        self.c = self.book.next_round(self.mkey, self.ident)
        self._opened = time.monotonic()
        for line in (self.line, _store.waiter(self.line_timeout, self.mkey, self.epoch)):
            if line is not None:  # connect (once per process) while this rank probes
                line.warm()
        return None

    def _decided_before(self, raw) -> Optional[Outcome]:
        """A register found before publishing: an abort (or all-pass) of this very call is
        followed; a commit without our record is stale (None: try the next round)."""
        reg = Register.from_json(raw)
        if reg.commit:
            self.c += 1
            return None
        return Outcome(False, register=reg, followed=True, key=self._k(),
                       missing=f"decided before this rank arrived: {reg.why or 'abort'}",
                       elapsed_s=time.monotonic() - self._opened)

    def vote(self, record: Record) -> Outcome:
        start = time.monotonic()
        own_yes = record.is_yes()
        entry = Board(self.book.new_generation(self.mkey), self.round_name,
                      "wait" if own_yes else "no", self.args, self.calls, self.book.world)
        step = self._vote_yes if own_yes else self._vote_no
        for _ in range(64):  # bounded: stale commits of an earlier incarnation are skipped
            self._entry = dataclasses.replace(entry, round=self.round_name)
            out = Outcome(False, key=self._k())
            early = step(out, record, self._rec_keys(), start)
            if early is not None:
                break
        out = early if isinstance(early, Outcome) else out
        self.book.consume(self.mkey, self.ident, self.c)
        self._finish()
        _points.hit("round.voted")
        out.elapsed_s = time.monotonic() - start
        return out

    def _publish_ops(self, record: Record):
        return [self._board_key(self.rank), self._k("rec", self.rank)], [
            self._entry.to_json(), record.to_json()]

    def _vote_no(self, out, record, keys, _start):
        """A no needs nobody else: the abort first, then the wake-up, then the record (one
        hand-off, after reading the register: a round decided before we came is followed)."""
        why = ("; ".join(_explain.describe(record, cand) for cand in record.candidates.values())
               or f"rank {self.rank} said no: {record.no_text()}")
        value = Register(ABORT, self.rank, why, check=record.failed_check(),
                         reasons=_explain.record_reasons(record)).to_json()
        reg_key, ready_key = self._k("reg"), self._k("ready")
        names, values = self._publish_ops(record)

        def no(s):
            before = _ops.get_if(s, reg_key)
            if before is not None:
                return before, False
            held = s.compare_set(reg_key, "", value)
            s.compare_set(ready_key, "", WAKE)
            _ops.multi_set(s, names, values)
            return held, True
        raw, published = self.call_store(no)
        if not published:
            return self._decided_before(raw)
        reg = Register.from_json(raw)
        self.published = True
        out.commit, out.register = reg.commit, reg
        out.records = _ops.records_if_all(self.call_store, keys) or [record]
        out.verdict = resolve(out.records) if len(out.records) == len(keys) else None
        self._watch.mismatches(abort_theirs=True)
        return False

    def _vote_yes(self, out, record, keys, start):
        """Read the register, publish and count in, in one hand-off; the count that
        completes the set also reads every record (one multi_get) and proposes; every
        other rank waits for the proposal and acknowledges it. False when ``out`` holds the
        answer; an Outcome to follow; None for a stale commit."""
        names, values = self._publish_ops(record)
        arrived, size, reg_key = self._k("arrived"), len(self.ranks), self._k("reg")

        def publish(s):
            before = _ops.get_if(s, reg_key)
            if before is not None:
                return "reg", before
            _ops.multi_set(s, names, values)
            if s.add(arrived, 1) < size:
                return "wait", None
            return "all", s.multi_get(keys)
        try:
            kind, raws = self.call_store(publish)
            if kind == "reg":
                return self._decided_before(raws)
            _points.hit("round.published")
            self.published = True
            if kind == "all":
                self._propose(out, [read_record(v) for v in raws])
            else:
                self._wait(out, record, keys, start)
        except _store.StoreTimeout:
            # the deadline passed inside a store operation (this rank was stopped, or the
            # store was slow): one last bounded try, so that a commit is never missed
            reg = self._final(f"rank {self.rank} reached its deadline")
            if reg is None:
                raise
            out.commit, out.register = reg.commit, reg
        return False

    def _propose(self, out, records: list) -> None:
        """This rank's record completed the set: a no, a mismatch or an all-pass decides
        the register at once; an all-yes is proposed, and the register awaited."""
        out.records, out.verdict = records, resolve(records)
        self.complete = True
        late = time.monotonic() >= self.deadline
        if not out.verdict.commit or late:
            wanted = PASS if out.verdict.all_pass and not late else ABORT
            why = f"rank {self.rank} reached its deadline" if late else out.verdict.why
            reg = self._write(wanted, why, check="" if late else out.verdict.check,
                              reasons=() if late else _explain.verdict_reasons(out.verdict, records))
        else:
            ready_key, reg_key = self._k("ready"), self._k("reg")
            until = self._store_until()

            def propose(s):
                proposed = _ops.text(s.compare_set(ready_key, "", PROPOSE)) == PROPOSE
                _points.hit("round.before_register")
                # proposed: wait for the register; else it was decided first (an abort woke us)
                return _ops.wait_get(s, reg_key, until) if proposed else _ops.get_if(s, reg_key)
            kind, raw = self._await(propose, reg_key, self.deadline)
            reg = self._register_or_abort(kind, raw)
        out.commit, out.register = reg.commit, reg

    def _wait(self, out, record, keys, start) -> None:
        """Wait in the store for ``ready``, and on a proposal acknowledge it and wait for the
        register, all on the waiting line; a missing peer's board is looked at from
        BOARD_AFTER_S on, and this rank's deadline ends the wait with an abort."""
        noted: list = []

        def tick():
            waiting, finished = self._watch.mismatches(abort_theirs=True)
            noted.extend(w for w in waiting if w.rank not in {n.rank for n in noted})
            if not finished:  # it decided another call without us: a mismatch
                return None
            # the register holds what won: our abort, or what a peer decided first (a no
            # whose wake-up has not reached us yet): followed like any register we read
            return self._write(ABORT, "ranks called with different arguments", mismatch=finished,
                               reasons=(ARG_MISMATCH,))

        kind, value = self._await(self._acknowledging(), self._k("ready"), self.deadline, tick)
        if kind == "tick":
            self._follow(out, record, keys, value)
        elif kind == "poll" and _ops.text(value) == PROPOSE:  # no waiting line: step by step
            self._acknowledge(out)
        elif kind == "poll":
            self._follow(out, record, keys, self._read_register())
        elif kind == "op" and value is not None:
            self._follow(out, record, keys, Register.from_json(value))
        else:
            now = time.monotonic()
            reg = self._write(ABORT, f"rank {self.rank} timed out after {now - start:.1f} s "
                              "waiting for the other ranks' records")
            out.commit, out.register = reg.commit, reg
            if reg.commit:  # acknowledged, and the commit landed just before our abort
                return
            absent = _ops.absent(self.call_store, self.ranks, keys)  # for the message, after
            out.absent = tuple(absent)
            out.missing = (f"timed out after {now - start:.1f} s waiting for ranks {absent}"
                           if absent else "timed out")
            if noted:  # the peers we saw making another call, for the message
                out.records = [record] + noted
                out.verdict = resolve(out.records)

    def _acknowledging(self):
        """The waiting line's whole part for a rank that is not the proposer: wait for
        ``ready``; on ``propose`` acknowledge (the acknowledgement that completes the
        count, every rank but the proposer, writes commit) and wait for the register; on
        ``wake`` read it. Returns the register's text, or None when a wait ran out."""
        ready_key, reg_key, acks_key = self._k("ready"), self._k("reg"), self._k("acks")
        need, until = len(self.ranks) - 1, self._store_until()
        commit = Register(COMMIT, self.rank, "every rank voted yes and acknowledged").to_json()

        def steps(s):
            ready = _ops.wait_get(s, ready_key, until)
            if ready is None:  # ran out (or the round is over and its keys are gone)
                return None
            if _ops.text(ready) != PROPOSE:
                return _ops.get_if(s, reg_key)  # written before any wake-up
            self.complete = self.acked = True  # before the add: never counted twice
            if _points.after(s.add(acks_key, 1), "round.acked") >= need:
                return s.compare_set(reg_key, "", commit)
            return _ops.wait_get(s, reg_key, until)
        return steps

    def _acknowledge(self, out) -> None:
        """``_acknowledging`` on the first line, for a store without a waiting line (or
        one that failed: if it acknowledged before failing, this rank does not count in a
        second time, and only waits for the register)."""
        self.complete = True
        acks_key = self._k("acks")
        acks = 0
        if not self.acked:
            self.acked = True
            acks = _points.after(self.call_store(lambda s: s.add(acks_key, 1)), "round.acked")
        if acks >= len(self.ranks) - 1:
            reg = self._write(COMMIT, "every rank voted yes and acknowledged")
        else:
            reg_key, until = self._k("reg"), self._store_until()
            kind, raw = self._await(lambda s: _ops.wait_get(s, reg_key, until), reg_key,
                                    self.deadline)
            reg = self._register_or_abort(kind, raw)
        out.commit, out.register = reg.commit, reg

    def _register_or_abort(self, kind, raw) -> Register:
        if raw is not None and kind in ("op", "poll"):
            return Register.from_json(raw)
        return self._write(ABORT, f"rank {self.rank} reached its deadline waiting for the "
                           "register")

    def _store_until(self) -> float:
        """Where a wait in the store gives up: after the caller's own deadline, where it
        writes the awaited key itself (abort, wake-up); torch logs no timed-out socket."""
        return self.deadline + GRACE_S + 1.0

    def _await(self, steps, poll_key: str, until: float, tick=None) -> tuple:
        """``steps(store)`` on this rank set's waiting line, polled on the first line where
        there is none (``store.await_op``)."""
        def poll():
            return self.call_store(lambda s: _ops.get_if(s, poll_key))
        line = _store.waiter(self.line_timeout, self.mkey, self.epoch)
        return _ops.await_op(line, steps, poll, until, tick, BOARD_AFTER_S, BOARD_EVERY_S)

    def _read_register(self) -> Register:  # written before any ``wake``: it exists
        return Register.from_json(self.call_store(lambda s, k=self._k("reg"): s.get(k)))

    def _final(self, why: str) -> Optional[Register]:
        reg_key = self._k("reg")
        value = Register(ABORT, self.rank, why).to_json()
        try:
            raw = self.line.call(lambda s: s.compare_set(reg_key, "", value),
                                 time.monotonic() + 0.4)
        except _store.StoreTimeout:
            return None
        return Register.from_json(raw)

    def _follow(self, out, record, keys, reg: Register) -> None:
        out.commit, out.register = reg.commit, reg
        if out.commit:
            return
        if reg.mismatch:
            out.records = [record] + list(reg.mismatch)
            out.verdict = resolve(out.records)
            return
        records = _ops.records_if_all(self.call_store, keys)
        if records:
            out.records, out.verdict = records, resolve(records)

    def _write(self, outcome: str, why: str, mismatch=(), check: str = "",
               reasons: tuple = ()) -> Register:
        """``compare_set`` on the register (the first write wins; what it holds is returned);
        any outcome but commit also wakes the ranks still waiting for the records."""
        reg_key, ready_key = self._k("reg"), self._k("ready")
        text = Register(outcome, self.rank, why, tuple(mismatch), check=check,
                        reasons=tuple(reasons)).to_json()

        def write(s):
            held = s.compare_set(reg_key, "", text)
            if outcome != COMMIT:
                s.compare_set(ready_key, "", WAKE)
            return held
        return Register.from_json(self.call_store(write))

    def _finish(self) -> None:
        """Count this rank out of the round (the last one removes the round's keys). A round
        that did not complete also marks this rank's board entry done and notes every
        peer's board generation as seen. Queued on the store line without waiting: it runs
        before this rank's next operation."""
        if self.finished:
            return
        self.finished = True
        records, register = self._rec_keys(), self._k("reg")
        others = [self._k(k) for k in ("arrived", "ready", "acks", "done")]
        entry = self._entry if (self.published and not self.complete) else None
        board_key, book, mkey, epoch = self._board_key(self.rank), self.book, self.mkey, self.epoch
        peers = [] if self.complete else [r for r in self.ranks if r != self.rank]
        # a round that did not complete is remembered until long decided (``leftovers``)
        not_before = None if self.complete else self.deadline + self.line_timeout + GRACE_S

        def wrap_up(s):
            if entry is not None:
                s.set(board_key, dataclasses.replace(entry, state="done").to_json())
            if peers:
                _board.note_peers_seen(s, book, mkey, peers)
            _leftovers.count_out(s, records, register, others, not_before, epoch, _store.epoch())
        self.line.submit(wrap_up)

    def abort_now(self, why: str) -> None:
        """Interrupted or failed mid-round: write abort (bounded, without waiting long)."""
        if self.c is None or self.finished:
            return
        reg_key, ready_key = self._k("reg"), self._k("ready")
        value = Register(ABORT, self.rank, why).to_json()

        def abort(s):
            s.compare_set(reg_key, "", value)
            s.compare_set(ready_key, "", WAKE)
        self.line.submit(abort).done.wait(0.2)
        self.book.consume(self.mkey, self.ident, self.c)
        self._finish()
