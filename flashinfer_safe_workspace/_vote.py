"""The agreement: one record per rank per decision, and one register that decides.

Every rank that reaches the wrapper for a multi-rank workspace publishes exactly one
record for the decision (also when its own plan or probe failed: then it says no and
why). The decision is the group-wide AND of the records' yes bits, gated on every rank
having made the same call with the same plan. Ranks learn it through one register per
decision in the c10d store, written with ``compare_set`` so that the first write wins
for everyone:

* a rank that saw every record, all yes and the same plan, writes ``commit``;
* a rank that said no, saw a no or a mismatch, was interrupted, or reached its deadline
  writes ``abort``;
* every rank returns what the register holds, including a rank whose own write lost. No
  clock of one host is compared with another's.

Keys: ``fiws/<ranks>/<n>/…`` where ``n`` counts this rank's decisions for that rank set.
A rank whose count is behind (it answered an earlier call from its veto cache, or took a
pass-through, while a peer waited) finds a register already decided. It follows that
register only if it is an ``abort`` that names its own call (the call it would have
joined); a ``commit`` is never followed by a rank that did not publish in it, and a
decided round of another call is skipped. So a skipped call costs at most one timed-out
round and never misaligns later decisions for good: the next call re-aligns on the first
undecided round. Keys of a round are deleted by the last rank to finish it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from typing import Any, Optional

from . import _store

MAGIC = "fiws1"

# reason codes carried in records
OK = 0
OUT_OF_MEMORY = 1
PROBE_ERROR = 2
INTERNAL_ERROR = 3
UNPLANNED = 4
NO_DEVICE = 5
ARG_MISMATCH = 6
UNKNOWN_VERSION = 7
PASS_THROUGH = 8
INTERRUPTED = 9
DRIVER_ERROR = 10

REASON_TEXT = {
    OK: "ok",
    OUT_OF_MEMORY: "out of memory",
    PROBE_ERROR: "probe failed",
    INTERNAL_ERROR: "internal error",
    UNPLANNED: "no allocation rule for this call",
    NO_DEVICE: "no usable CUDA driver or device",
    ARG_MISMATCH: "arguments disagree with the group",
    UNKNOWN_VERSION: "FlashInfer release not mirrored",
    PASS_THROUGH: "FlashInfer rejects these arguments before allocating",
    INTERRUPTED: "interrupted",
    DRIVER_ERROR: "a CUDA driver query failed",
}

COMMIT, ABORT, PASS = "commit", "abort", "pass"  # PASS: every rank calls FlashInfer, which
# rejects the arguments itself (the same call on every rank, so the same error)
REJOIN_S = 0.5  # a peer whose mismatched call we aborted gets this long to join our round
GRACE_S = 1.0  # store operations may end this long after the deadline; with the final
# register read (0.4 s) and an abort written on the way out (0.2 s) the bound stays T + 2 s


def digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the verdict


@dataclasses.dataclass
class Verdict:
    commit: bool
    why: str = ""
    candidate: str = ""  # which candidate the group resolved to ("-", "mc", "nomc")
    no: tuple = ()  # positions (in the rank set) that said no
    passing: tuple = ()  # positions whose FlashInfer call rejects the arguments itself
    mismatch: tuple = ()  # (field, {value: [positions]}) pairs
    plan_mismatch: tuple = ()  # positions whose plan digest differs
    all_pass: bool = False  # every rank's FlashInfer call rejects the arguments itself


def resolve(records: list) -> Verdict:
    """The group's answer from every rank's record (pure; the same on every rank)."""
    bad = [i for i, r in enumerate(records) if not isinstance(r, dict) or r.get("m") != MAGIC]
    if bad:
        return Verdict(False, f"malformed records from positions {bad}")
    idents = {r["id"] for r in records}
    if len(idents) > 1:
        fields = sorted({k for r in records for k in r.get("args", {})})
        diff = []
        for name in fields:
            by_value: dict = {}
            for pos, r in enumerate(records):
                by_value.setdefault(repr(r.get("args", {}).get(name)), []).append(pos)
            if len(by_value) > 1:
                diff.append((name, by_value))
        return Verdict(False, "ranks called with different arguments", mismatch=tuple(diff))
    auto = bool(records[0].get("auto"))
    cand = "-"
    if auto:
        cand = "mc" if all(r.get("mc") for r in records) else "nomc"
    states = [r.get("c", {}).get(cand) or {"s": "no", "r": INTERNAL_ERROR,
                                             "n": f"no {cand} candidate"} for r in records]
    passing = tuple(i for i, s in enumerate(states) if s.get("s") == "pass")
    no = tuple(i for i, s in enumerate(states) if s.get("s") not in ("ok", "pass"))
    if passing and len(passing) == len(states):  # every rank: FlashInfer rejects it itself
        return Verdict(False, "FlashInfer rejects these arguments on every rank", cand,
                       passing=passing, all_pass=True)
    if no or passing:
        why = "a rank said no" if no else "FlashInfer rejects the arguments on some ranks only"
        return Verdict(False, why, cand, no, passing)
    digests = [s.get("d") for s in states]
    common = max(set(digests), key=digests.count)
    differ = tuple(i for i, d in enumerate(digests) if d != common)
    if differ:
        return Verdict(False, "plans differ between ranks", cand, plan_mismatch=differ)
    return Verdict(True, "every rank voted yes", cand)


# --------------------------------------------------------------------------- outcome


@dataclasses.dataclass
class Outcome:
    commit: bool
    verdict: Optional[Verdict] = None
    records: list = dataclasses.field(default_factory=list)  # complete set, when seen
    register: dict = dataclasses.field(default_factory=dict)
    missing: str = ""  # why the round did not complete normally
    absent: tuple = ()  # ranks whose record never arrived
    in_doubt: bool = False  # the register could not be read: this rank vetoes
    followed: bool = False  # answered from a register decided before this rank arrived
    elapsed_s: float = 0.0
    key: str = ""


# --------------------------------------------------------------------------- rounds

_counters: dict = {}  # (members key, identity) -> this rank's next round of that call
_gens: dict = {}  # members key -> this rank's board generation
_seen: dict = {}  # members key -> {peer rank: board generation seen at the end of a round}
_locks: dict = {}  # members key -> lock serialising this rank's decisions on that set
_meta = threading.Lock()


def set_lock(members_key: str) -> threading.Lock:
    with _meta:
        lock = _locks.get(members_key)
        if lock is None:
            lock = _locks[members_key] = threading.Lock()
        return lock


def _after_fork_in_child():
    global _meta
    _meta = threading.Lock()
    _locks.clear()
    _counters.clear()
    _gens.clear()
    _seen.clear()
    _blocked.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def members_key(ranks: tuple) -> str:
    if len(ranks) <= 32:
        return "-".join(map(str, ranks))
    return f"{len(ranks)}x{digest(list(ranks))}"


class LocalRound:
    """A group of one (world_size 1, or no process group): nothing to agree on."""

    label = "local"

    def __init__(self, label: str = "local"):
        self.label = label
        self.decided = None

    def open(self):
        return None

    def vote(self, record: dict) -> Outcome:
        start = time.monotonic()
        verdict = resolve([record])
        return Outcome(verdict.commit, verdict, [record],
                       register={"o": PASS} if verdict.all_pass else {},
                       elapsed_s=time.monotonic() - start)

    def abort_now(self, why: str) -> None:
        pass


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
        with _meta:
            c = _counters.get((self.mkey, self.ident), 0)
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
        with _meta:
            key = (self.mkey, self.ident)
            _counters[key] = max(_counters.get(key, 0), self.c + 1)

    def vote(self, record: dict) -> Outcome:
        start = time.monotonic()
        keys = self._rec_keys()
        mine, reg_key = self._k("rec", self.rank), self._k("reg")
        own_yes = _is_yes(record)
        with _meta:
            gen = _gens[self.mkey] = _gens.get(self.mkey, 0) + 1
        board = json.dumps({"g": gen, "k": self.round_name, "s": "wait" if own_yes else "no",
                            "a": self.args})
        payload = json.dumps(record, sort_keys=True, default=str)
        board_key = self._board(self.rank)
        self._call(lambda s: (s.set(board_key, board), s.set(mine, payload)))
        self.published = True
        out = Outcome(False, key=self._k())
        if not own_yes:  # a no needs nobody else: decide now, and tell peers waiting elsewhere
            reg = self._write(ABORT, f"rank {self.rank} said no: {_no_text(record)}")
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
        pause, polls, noted = 0.0002, 0, []
        while True:
            polls += 1
            all_in, raw = self._call(
                lambda s: (s.check(keys), s.get(reg_key) if s.check([reg_key]) else None))
            if raw is not None:  # somebody decided (an abort: a commit needs our record too)
                reg = _loads(raw)
                out.commit, out.register = reg.get("o") == COMMIT, reg
                if all_in:
                    out.records = self._records(keys)
                    out.verdict = resolve(out.records)
                elif reg.get("mismatch"):
                    out.records = [record] + reg["mismatch"]
                    out.verdict = resolve(out.records)
                break
            if all_in:
                out.records = self._records(keys)
                out.verdict = resolve(out.records)
                wanted = COMMIT if out.verdict.commit else (PASS if out.verdict.all_pass else ABORT)
                if wanted != ABORT and time.monotonic() >= self.deadline:
                    wanted = ABORT
                reg = self._write(wanted, out.verdict.why)
                out.commit, out.register = reg.get("o") == COMMIT, reg
                break
            if polls == 1 or polls % 8 == 0:  # is a missing peer making another call now?
                waiting, finished = self._mismatches(record, abort_theirs=True)
                noted = noted or waiting
                if finished:  # it decided another call without us: a mismatch, decide now
                    out.records = [record] + finished
                    out.verdict = resolve(out.records)
                    reg = self._write(ABORT, "ranks called with different arguments",
                                      mismatch=finished)
                    out.commit, out.register = reg.get("o") == COMMIT, reg
                    break
            if time.monotonic() >= self.deadline:
                absent = self._absent(keys)
                out.absent = tuple(absent)
                out.missing = (f"timed out after {time.monotonic() - start:.1f} s waiting for "
                               f"ranks {absent}" if absent else "timed out")
                reg = self._write(ABORT, out.missing)
                out.commit, out.register = reg.get("o") == COMMIT, reg
                if noted:  # the peers we saw making another call, for the message
                    out.records = [record] + noted
                    out.verdict = resolve(out.records)
                break
            time.sleep(min(pause, max(self.deadline - time.monotonic(), 0)))
            pause = min(pause * 2, 0.005)

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
            with _meta:
                known = dict(_seen.get(self.mkey, {}))
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
            with _meta:
                behind_us = _counters.get((self.mkey, ident), 0) > int(c or 0)
            if behind_us:  # a round this rank already finished: old news, not a mismatch
                with _meta:
                    marks = _seen.setdefault(self.mkey, {})
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
                with _meta:
                    marks = _seen.setdefault(self.mkey, {})
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
        keys = self._rec_keys() + [self._k("reg"), done_key]
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
            with _meta:
                seen = _seen.setdefault(mkey, {})
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


def _is_yes(record: dict) -> bool:
    """Whether this record can still be part of a commit (or of an all-pass): such a rank
    waits for every record; any other rank decides abort at once."""
    cands = record.get("c", {})
    if not cands:
        return False
    states = [c.get("s") for c in cands.values()]
    if record.get("auto"):
        return any(s in ("ok", "pass") for s in states)
    return all(s in ("ok", "pass") for s in states)


def _no_text(record: dict) -> str:
    """A rank's reasons for its no, short (for the register, which late ranks read)."""
    parts = []
    for cand in record.get("c", {}).values():
        text = REASON_TEXT.get(cand.get("r"), "no")
        note = cand.get("n")
        parts.append(f"{text}: {note}" if note and note != text else text)
    return "; ".join(parts)[:400] or "no"


def _loads(raw) -> dict:
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode()
    try:
        value = json.loads(raw)
    except ValueError:
        return {"o": ABORT, "why": "unreadable value in the store"}
    return value if isinstance(value, dict) else {"o": ABORT, "why": "unreadable value"}


# --------------------------------------------------------------------------- comm backends

_blocked: dict = {}  # id(comm) -> the helper thread still inside its allgather


class AllgatherRound:
    """A FlashInfer ``CommBackend`` with no torch group (MPI, custom): the records travel
    through its own ``allgather`` on a helper thread. There is no shared register, so
    every rank whose gather completes decides on the same records; a rank whose gather
    does not complete in time vetoes. At most one helper thread per backend can be left
    blocked: while it is, later decisions on that backend veto at once."""

    def __init__(self, comm, size: int, me: int, ident: str, deadline: float, label: str):
        self.comm, self.size, self.me, self.ident = comm, size, me, ident
        self.deadline, self.label = deadline, label
        self.decided = None

    def open(self):
        return None

    def vote(self, record: dict) -> Outcome:
        """Two exchanges: the records, then every rank's verdict on what it received. The
        decision is the AND of the second: a rank that received a short or malformed answer
        says so, and no peer creates."""
        start = time.monotonic()
        got, why = self._gather(dict(record))
        if got is None and why.startswith("!"):  # blocked or failed: no second exchange
            return Outcome(False, missing=why[1:], elapsed_s=time.monotonic() - start)
        verdict = resolve(got) if got is not None else None
        mine = bool(verdict is not None and (verdict.commit or verdict.all_pass))
        second, why2 = self._gather({"m": MAGIC, "ok": mine, "why": why})
        if second is None:
            return Outcome(False, verdict, got or [], missing=why2.lstrip("!"),
                           elapsed_s=time.monotonic() - start)
        every = all(isinstance(r, dict) and r.get("m") == MAGIC and r.get("ok") is True
                    for r in second)
        missing = "" if every else (why or "a rank rejected the exchange: " + "; ".join(
            str(r.get("why")) for r in second if isinstance(r, dict) and r.get("why")))
        passing = every and mine and not verdict.commit
        return Outcome(every and mine and verdict.commit, verdict, got or [],
                       register={"o": PASS} if passing else {},
                       missing=missing if not every else "", elapsed_s=time.monotonic() - start)

    def _gather(self, obj):
        """(records, "") or (None, why); why starts with "!" when no second exchange can run."""
        key = id(self.comm)
        old = _blocked.get(key, (None, None))[1]
        if old is not None and old.is_alive():
            return None, (f"!an earlier vote on {self.label} is still blocked in its allgather; "
                          "not voting again on it")
        box: dict = {}

        def run():
            try:
                box["value"] = self.comm.allgather(obj)
            except BaseException as exc:  # noqa: BLE001 - reported below
                box["error"] = exc

        thread = threading.Thread(target=run, name="fiws-allgather", daemon=True)
        thread.start()
        while thread.is_alive() and time.monotonic() < self.deadline:
            thread.join(min(_store.SLICE_S, max(self.deadline - time.monotonic(), 0.001)))
        if thread.is_alive():
            _blocked[key] = (self.comm, thread)  # holding the comm: its id stays its own
            return None, f"!{self.label}: allgather did not complete in time"
        if "error" in box:
            return None, (f"!{self.label}: allgather failed: {type(box['error']).__name__}: "
                          f"{box['error']}")
        got = box.get("value")
        if not isinstance(got, (list, tuple)) or len(got) != self.size:
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return None, f"{self.label}: allgather returned {n} records for {self.size} ranks"
        return list(got), ""

    def abort_now(self, why: str) -> None:
        pass
