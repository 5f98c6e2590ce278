"""What a vetoed call says: the message (our own sentence first: which rank, what failed,
what to do; then the details, one per rank that said no, transport errors last) and the
veto WARNING's first sentence (``headline``), from the round's outcome and the register's
explanation (``agreement/explain``)."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from . import _reasons as _rec
from .agreement.explain import describe, from_verdict, shortfalls
from .agreement.record import Record
from .planning.plan import MiB


@dataclasses.dataclass
class VetoInfo:
    message: str
    ranks: tuple
    details: tuple
    reasons: tuple = ()  # reason codes (``_reasons``), sorted
    # for ``headline``: (rank, device, bytes short) of each rank that ran out of memory,
    # bytes = plan + headroom - free (-1: not known); and whether this rank decided alone
    short: tuple = ()
    alone: bool = False
    # the store did not answer: this rank cannot tell whether the group committed
    doubt: bool = False
    # who ended the round, in words, when no rank's own no explains it (another rank's
    # deadline that found every record in by now, an interrupt): the headline's cause
    lead: str = ""


def local(message: str, reasons=()) -> VetoInfo:
    return VetoInfo(f"FlashInfer all-reduce workspace not created: {message}", (), (message,),
                    tuple(sorted(reasons)), alone=True)


def _missing_reason(outcome) -> int:
    """Why a round that did not complete vetoed, as a reason code."""
    if outcome.absent:
        return _rec.ABSENT
    if outcome.missing.startswith("internal error"):
        return _rec.INTERNAL_ERROR
    if outcome.in_doubt:
        return _rec.STORE_ERROR
    return _rec.INCOMPLETE


def _advice(reasons: set) -> str:
    if reasons & {_rec.OUT_OF_MEMORY}:
        return ("Free GPU memory on that rank (or lower FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB) "
                "and create the workspace again.")
    if reasons & {_rec.ARG_MISMATCH, _rec.RENDEZVOUS_GROUP}:
        return ("Call with the same arguments on every rank of the group, and pass the group "
                "FlashInfer rendezvouses on (group=) where the release takes it.")
    if reasons & {_rec.CAPTURING}:
        return "Create the workspace before CUDA graph capture."
    if reasons & {_rec.ABSENT}:
        return ("Every rank of the group must make the same call within the vote timeout "
                "(FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT).")
    if reasons & {_rec.PROBE_ERROR}:
        return "The probe's CUDA error is above; docs/when-it-vetoes.md says what each means."
    return "docs/when-it-vetoes.md says what each reason means."


def _dedupe(details: list) -> list:
    seen, out = set(), []
    for d in details:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def veto(outcome, members, plan, record: Optional[Record]) -> VetoInfo:
    """The message for a vetoed decision (``outcome``: the round's ``vote.Outcome``). A
    register that explains its abort (its decider read the records, or said no itself)
    gives every rank the same details; the rest is this rank's own account."""
    ranks = list(members.ranks) if members is not None else []
    need = f" (plan {_size(plan.peak_bytes)} per rank)" if plan is not None else ""
    head = (f"FlashInfer all-reduce workspace not created on this rank (ranks {ranks}){need}: "
            if outcome.in_doubt else
            f"FlashInfer all-reduce workspace not created on any of ranks {ranks}{need}: ")
    verdict, records, reg = outcome.verdict, outcome.records, outcome.register
    details, named, reasons = [], [], set()
    short, lead = (), ""
    own = shortfalls(None, [], record)  # this rank's own no, when it lacked memory
    used = reg is not None and not reg.commit and bool(reg.details)
    if used:
        details, named, reasons = list(reg.details), list(reg.named), set(reg.reasons)
        short = tuple(reg.short) + tuple(s for s in own if s[0] not in {x[0] for x in reg.short})
        if record is not None and not record.is_yes() and record.rank not in reg.named:
            for cand in record.candidates.values():  # this rank's own no too, beside the
                details.append(describe(record, cand))  # one that decided
                reasons.add(cand.reason)
            named.append(record.rank)
        call = record.call if record is not None else ""
        if reg.call and call and reg.call != call:  # the round's other rank(s) made another call
            details.append("this rank made another call at this position: the group's "
                           "calls are out of step or their arguments differ")
            reasons.add(_rec.ARG_MISMATCH)
    elif verdict is not None and records and not verdict.commit:
        from_verdict(verdict, records, ranks, details, named, reasons)
        short = shortfalls(verdict, records, None)
    elif record is not None and not record.is_yes():
        for cand in record.candidates.values():
            details.append(describe(record, cand))
            reasons.add(cand.reason)
        named.append(record.rank)
        short = own
    register_why = (reg.why if reg is not None else "") or ""
    if outcome.missing:
        reasons.add(_missing_reason(outcome))
        absent = list(outcome.absent)
        lead_text = (f"ranks {absent} did not answer in time" if absent
                     else "the round did not complete")
        details.append(f"{lead_text}; detail: {outcome.missing}")
        named.extend(absent)
    elif not details or (reg is not None and not reg.commit and not used and record is not None
                         and reg.by is not None and reg.by != record.rank):
        # the register another rank wrote without an explanation (its deadline, an
        # interrupt) decided: say so, beside this rank's own no
        details.append(f"the group aborted: {register_why or 'no reason given'}")
        codes = set(reg.reasons) if reg is not None else set()
        if codes and codes != {_rec.ABSENT}:
            reasons.update(codes)
        else:  # an interrupt, or a deadline that finds every record in by now (else the
            reasons.add(_rec.ABORTED)  # driver named the absent ranks: ``missing``)
            if register_why.startswith("rank "):
                lead = register_why
    message = head + "; ".join(_dedupe(details)).rstrip(". ") + ". " + _advice(reasons)
    return VetoInfo(message, tuple(sorted({r for r in named if isinstance(r, int)})),
                    tuple(_dedupe(details)), tuple(sorted(reasons)), short=short,
                    doubt=bool(outcome.in_doubt), lead=lead)


def verdict_reasons(verdict, records) -> tuple:
    """The reason codes of a decided abort (what its register carries to late ranks)."""
    reasons: set = set()
    try:
        from_verdict(verdict, records, [], [], [], reasons)
    except Exception:  # noqa: BLE001 - only for the message: late ranks then say ABORTED
        return ()
    return tuple(sorted(reasons))


# --------------------------------------------------------------------------- the headline
#
# The veto WARNING's first sentence (``_wrapper._refuse``): which rank failed, why, and what
# every rank now does, in plain words. Built from a ``VetoInfo`` alone; never raises.

_DIFFERS = re.compile(r"^(\w+) differs: ")
_PLAIN = {  # a reason in words that follow "rank 0" / "ranks 0 and 1"
    _rec.ARG_MISMATCH: "called with different arguments",
    _rec.ABSENT: "did not answer within the vote timeout",
    _rec.CAPTURING: "was called during CUDA graph capture",
    _rec.STEP_TIMEOUT: "did not finish its own steps (plan, checks, probe) in time",
}


def _rank(r: int) -> str:
    return f"rank {r}" if r >= 0 else "this rank"  # -1: torch.distributed not initialised


def _ranks(ranks) -> str:
    if len(ranks) == 1:
        return _rank(ranks[0])
    if any(r < 0 for r in ranks):  # -1: torch.distributed not initialised
        return " and ".join(_rank(r) for r in ranks)
    ranks = [str(r) for r in ranks]
    return f"ranks {', '.join(ranks[:-1])} and {ranks[-1]}"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    if n < MiB:
        return f"{n / 1024:.0f} KiB"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.1f} MiB"


def _words(codes) -> str:
    return "; ".join(_rec.REASON_TEXT.get(c, f"reason {c}") for c in codes) or "no reason given"


def cause(info: VetoInfo) -> str:
    """Who said no and why, in words: ``rank 0 was 82 MiB short on cuda:0``."""
    reasons = set(info.reasons)
    if info.short:
        said = [f"{_rank(r)} was {_size(b)} short" + (f" on cuda:{d}" if d >= 0 else "")
                if b > 0 else
                f"{_rank(r)} ran out of GPU memory" + (f" on cuda:{d}" if d >= 0 else "")
                for r, d, b in info.short]
        text = " and ".join(said)
        rest = sorted(reasons - {_rec.OUT_OF_MEMORY})
        return text + (f" (also: {_words(rest)})" if rest else "")
    if info.alone:
        return (f"this rank vetoed the call on its own ({info.details[0][:160]})" if info.details
                else f"this rank vetoed the call on its own ({_words(sorted(reasons))})")
    if info.doubt and not info.ranks:
        return "the c10d store did not answer this rank in time"
    who = _ranks(info.ranks) if info.ranks else "a rank"
    if info.lead and not info.ranks:
        return info.lead
    if _rec.ARG_MISMATCH in reasons:
        names = [m.group(1) for m in map(_DIFFERS.match, info.details) if m]
        return (f"{who} called with different arguments"
                + (f" ({', '.join(names)})" if names else ""))
    if len(reasons) == 1 and next(iter(reasons)) in _PLAIN:
        return f"{who} {_PLAIN[next(iter(reasons))]}"
    return f"{who} said no ({_words(sorted(reasons))})"


def headline(info: VetoInfo, then: str = "") -> str:
    """The veto's first sentence: which rank failed, why, and what every rank now does
    (``then``, e.g. for the legacy entry, replaces the non-fused path). Never raises."""
    try:
        text = cause(info)
    except Exception:  # noqa: BLE001 - a message must never fail the call
        text = "a rank said no"
    if info.alone:
        return (f"{text}, so this rank did not create FlashInfer's all-reduce workspace; "
                f"{then or 'it takes the non-fused all-reduce path'}.")
    if getattr(info, "doubt", False):  # it cannot tell what its peers did
        return (f"{text}, so this rank did not create FlashInfer's all-reduce workspace and "
                "cannot tell whether its peers did (in doubt); "
                f"{then or 'it takes the non-fused all-reduce path'}.")
    return (f"{text}, so no rank created FlashInfer's all-reduce workspace; "
            f"{then or 'every rank takes the non-fused all-reduce path'}.")
