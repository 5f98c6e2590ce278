"""The verdict over every rank's records, and the values of a round's register.

``resolve`` is the group's answer from every rank's record (pure: the same on every rank
that reads them): the AND of their yes, gated on every rank having made the same call
with the same plan and on the cross-rank comparisons (handed in by ``_decide``).
``codec_for`` gives the core (``core``) its view of the values: the register the rank that
completes a round's count writes, with its explanation (``explain``). ``Outcome`` is what
a round tells the caller; ``LocalRound`` decides a group of one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from .._log import internal_error
from .._reasons import INTERNAL_ERROR
from ..planning.plan import digest
from . import core as _core, explain as _explain, process as _process
from .record import NO, PASS, PASS_STATE, YES, Candidate, Record, Register, read_record

__all__ = ["GRACE_S", "LocalRound", "Outcome", "Verdict", "codec_for", "digest", "members_key",
           "resolve", "use_comparison"]

GRACE_S = 1.0  # a rank's abort may take this long to be answered; within T + 2 s in all


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
    checks: tuple = ()  # checks.Failure of the cross-rank checks that failed
    check: str = ""  # the name of the check that decided a veto ("" when none did)
    internal: bool = False  # our own failure decided it (no comparison to run): INTERNAL_ERROR


# --------------------------------------------------------------------------- the comparisons
#
# The cross-rank checks are handed in: the agreement runs them and knows nothing of which
# checks exist. ``_decide`` registers ``checks.compare`` once, at its import (before any
# round can be built); a plain module global, so a forked child inherits it and install()/
# uninstall() leave it alone. A re-imported ``_decide`` registers again: the last one wins.

NO_COMPARISON = "no cross-rank comparison was handed to the agreement"
_comparison: Optional[Callable[[list], list]] = None


def use_comparison(compare: Callable[[list], list]) -> None:
    """Hand the agreement the cross-rank comparisons: ``compare(records) -> [failures]``
    (pure, the same on every rank). Its one caller is ``_decide``."""
    global _comparison
    if not callable(compare):
        raise TypeError(f"use_comparison needs a callable, not {type(compare).__name__}")
    _comparison = compare


def _cross_checks(records: list) -> Optional[list]:
    """The handed-in comparisons over every rank's record; None (fail closed: a no) when
    none was handed in or it raised."""
    compare = _comparison
    try:
        if compare is None:
            raise RuntimeError(NO_COMPARISON)
        return list(compare(records))
    except Exception as exc:  # noqa: BLE001 - our bug: this rank's answer is no
        internal_error("vote.compare", exc)
        return None


def resolve(records: list) -> Verdict:
    """The group's answer from every rank's record (pure; the same on every rank). A
    position holding None had an unreadable record."""
    bad = [i for i, r in enumerate(records) if not isinstance(r, Record)]
    if bad:
        return Verdict(False, f"malformed records from positions {bad}")
    if len({r.call for r in records}) > 1:
        fields = sorted({k for r in records for k in r.args})
        diff = []
        for name in fields:
            by_value: dict = {}
            for pos, r in enumerate(records):
                by_value.setdefault(repr(r.args.get(name)), []).append(pos)
            if len(by_value) > 1:
                diff.append((name, by_value))
        return Verdict(False, "ranks called with different arguments", mismatch=tuple(diff))
    failures = _cross_checks(records)
    if failures is None:
        return Verdict(False, f"internal error: {NO_COMPARISON}" if _comparison is None
                       else "internal error: the cross-rank comparison failed", internal=True)
    cand = "-"
    if records[0].auto:
        cand = "mc" if all(r.multicast for r in records) else "nomc"
    missing = Candidate(NO, INTERNAL_ERROR, f"no {cand} candidate")
    states = [r.candidates.get(cand, missing).state for r in records]
    passing = tuple(i for i, s in enumerate(states) if s == PASS_STATE)
    no = tuple(i for i, s in enumerate(states) if s not in (YES, PASS_STATE))
    if passing and len(passing) == len(states):  # every rank: FlashInfer rejects it itself
        return Verdict(False, "FlashInfer rejects these arguments on every rank", cand,
                       passing=passing, all_pass=True)
    if no or passing or failures:
        why = ("a rank said no" if no else "a check across ranks failed" if failures
               else "FlashInfer rejects the arguments on some ranks only")
        named = next((records[i].failed_check() for i in no if records[i].failed_check()), "")
        return Verdict(False, why, cand, no, passing, checks=tuple(failures),
                       check=failures[0].check if failures else named)
    digests = [r.candidates[cand].plan_digest for r in records]
    common = max(set(digests), key=digests.count)
    differ = tuple(i for i, d in enumerate(digests) if d != common)
    if differ:
        return Verdict(False, "plans differ between ranks", cand, plan_mismatch=differ)
    return Verdict(True, "every rank voted yes", cand)


# --------------------------------------------------------------------------- the codec


def codec_for(rank: int, call: str, seen: Optional[dict] = None) -> _core.Codec:
    """The core's view of the values (``core.Codec``) for rank ``rank`` deciding ``call``:
    registers from the records, with their explanation (``explain``). ``seen`` (a dict)
    gets the records and the verdict this rank read, so they are parsed once."""
    seen = {} if seen is None else seen

    def verdict(payloads: list) -> str:
        records = [read_record(p) for p in payloads]
        gone = _gone(records)
        if gone:  # a yes of a process that no longer runs: never a commit on it
            seen.update(records=records, verdict=Verdict(False, "a record's writer is gone"))
            return _explain.writers_gone(records, gone, rank, call).to_text()
        found = resolve(records)
        seen.update(records=records, verdict=found)
        return _explain.decided(found, records, rank, call).to_text()

    def refuse(payloads: list, why: str) -> str:
        records = [read_record(p) for p in payloads]
        try:
            found = resolve(records) if records else Verdict(False, why)
        except Exception as exc:  # noqa: BLE001 - only for the message: the abort stands
            internal_error("vote.refuse", exc)
            found = Verdict(False, why)
        if found.commit or found.all_pass:  # the core refuses it: never a commit or a pass
            found = Verdict(False, why)
        seen.update(records=records, verdict=found)
        return _explain.decided(found, records, rank, call).to_text()

    return _core.Codec(verdict, refuse, _outcome, _complete)


def _gone(records: list) -> list:
    """The positions whose record is older than ``process.STALE_S`` and whose writer is
    known to be gone (``process.gone``); [] on a healthy round without a look."""
    now, out = time.time(), []
    for pos, rec in enumerate(records):
        if not isinstance(rec, Record) or not isinstance(rec.at, (int, float)) or not rec.at:
            continue  # a record that cannot be dated stands as it is
        try:
            if now - rec.at > _process.STALE_S and _process.gone(rec.pid, rec.proc):
                out.append(pos)
        except Exception as exc:  # noqa: BLE001 - cannot tell: the record stands
            internal_error("vote.gone", exc)
    return out


def _outcome(text: str) -> str:
    return Register.from_text(text).outcome


def _complete(text: str) -> bool:
    return Register.from_text(text).complete


# --------------------------------------------------------------------------- outcome


@dataclasses.dataclass
class Outcome:
    commit: bool
    verdict: Optional[Verdict] = None
    records: list = dataclasses.field(default_factory=list)  # complete set, when seen
    register: Optional[Register] = None
    missing: str = ""  # why the round did not complete normally
    absent: tuple = ()  # ranks whose record never arrived
    in_doubt: bool = False  # the register could not be read: this rank vetoes
    followed: bool = False  # answered from a register decided before this rank arrived
    elapsed_s: float = 0.0
    key: str = ""


# --------------------------------------------------------------------------- rounds


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

    def vote(self, record: Record) -> Outcome:
        start = time.monotonic()
        verdict = resolve([record])
        return Outcome(verdict.commit, verdict, [record],
                       register=Register(PASS) if verdict.all_pass else None,
                       elapsed_s=time.monotonic() - start)

    def abort_now(self, why: str) -> None:
        pass
