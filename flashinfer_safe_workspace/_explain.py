"""The veto message: our own sentence first (which rank, what failed, what to do), then the
details (one per rank that said no, transport errors last)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import _vote
from ._plan import MiB


@dataclasses.dataclass
class VetoInfo:
    message: str
    ranks: tuple
    details: tuple


def local(message: str) -> VetoInfo:
    return VetoInfo(f"FlashInfer all-reduce workspace not created: {message}", (), (message,))


def _where(record: dict, cand: dict) -> str:
    rank = record.get("rank", "?")
    dev = cand.get("dev", -1)
    return f"rank {rank}" + (f" (cuda:{dev})" if isinstance(dev, int) and dev >= 0 else "")


def describe(record: dict, cand: dict) -> str:
    """One rank's "no", in words."""
    reason = cand.get("r")
    where = _where(record, cand)
    if reason in (_vote.OUT_OF_MEMORY, _vote.PROBE_ERROR) and cand.get("fail"):
        err = "CUDA_ERROR_OUT_OF_MEMORY" if cand.get("err") == 2 else (
            cand.get("errn") or f"CUDA error {cand.get('err')}")
        what = "the headroom" if cand.get("fh") else "cuMemCreate"
        free = cand.get("free", -1)
        free_text = f", {free / (1 << 30):.2f} GiB free" if isinstance(free, int) and free >= 0 else ""
        return (f"{where}: {what} of {cand.get('fail', 0) / MiB:.1f} MiB failed: {err}{free_text} "
                f"(plan {cand.get('peak', 0) / MiB:.1f} MiB + headroom "
                f"{cand.get('head', 0) / MiB:.0f} MiB)")
    text = _vote.REASON_TEXT.get(reason, f"reason {reason}")
    note = cand.get("n")
    return f"{where}: {text}" + (f": {note}" if note and note != text else "")


def _advice(reasons: set) -> str:
    if reasons & {_vote.OUT_OF_MEMORY}:
        return ("Free GPU memory on that rank (or lower FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB); "
                "until then the non-fused all-reduce is used.")
    if reasons & {_vote.ARG_MISMATCH}:
        return "Call with the same arguments on every rank of the group."
    return "The non-fused all-reduce is used."


def veto(outcome: "_vote.Outcome", members, plan, record: Optional[dict]) -> VetoInfo:
    ranks = list(members.ranks) if members is not None else []
    need = f" (plan {plan.peak_bytes / MiB:.1f} MiB per rank)" if plan is not None else ""
    head = f"FlashInfer all-reduce workspace not created on any of ranks {ranks}{need}: "
    verdict, records = outcome.verdict, outcome.records
    details, named, reasons = [], [], set()
    if verdict is not None and records and not verdict.commit:
        def rank_of(pos):
            r = records[pos]
            return r.get("rank", ranks[pos] if pos < len(ranks) else pos) if isinstance(r, dict) else pos

        for name, by_value in verdict.mismatch:
            by_value = dict(sorted(by_value.items(), key=lambda item: min(rank_of(p) for p in item[1])))
            parts = [f"{value} on rank{'s' if len(pos) > 1 else ''} "
                     f"{', '.join(str(rank_of(p)) for p in pos)}" for value, pos in by_value.items()]
            details.append(f"{name} differs: " + "; ".join(parts))
            reasons.add(_vote.ARG_MISMATCH)
            for pos_list in by_value.values():
                named.extend(rank_of(p) for p in pos_list)
        if verdict.mismatch:
            named = sorted(set(named))
        for pos in verdict.no + verdict.passing:
            cand = records[pos].get("c", {}).get(verdict.candidate) or {}
            details.append(describe(records[pos], cand))
            reasons.add(cand.get("r"))
            named.append(rank_of(pos))
        for pos in verdict.plan_mismatch:
            details.append(f"rank {rank_of(pos)}: its plan differs from the other ranks' "
                           "(different GPU facts or FlashInfer release)")
            named.append(rank_of(pos))
        if not details:
            details.append(verdict.why)
    elif record is not None and not _vote._is_yes(record):
        for cand in record.get("c", {}).values():
            details.append(describe(record, cand))
            reasons.add(cand.get("r"))
        named.append(record.get("rank"))
    if outcome.followed:
        details.append(f"{outcome.register.get('why', 'abort')} (decided before this rank "
                       "arrived)")
    elif outcome.missing:
        absent = list(outcome.absent)
        lead = (f"ranks {absent} did not answer in time" if absent
                else "the round did not complete")
        details.append(f"{lead}; detail: {outcome.missing}")
        named.extend(absent)
    elif not details:
        details.append(f"the group aborted: {outcome.register.get('why', 'no reason given')}")
    message = head + "; ".join(details) + ". " + _advice(reasons)
    return VetoInfo(message, tuple(sorted({r for r in named if isinstance(r, int)})), tuple(details))
