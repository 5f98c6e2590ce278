"""What a deciding rank writes into the register: an abort's whole explanation (the
details, one per rank that said no or cause, the reason codes, the ranks named, how many
bytes each rank out of memory was short), so every rank's veto says the same (``_veto``
renders it)."""

from __future__ import annotations

from .. import _reasons as _rec
from .record import ABORT, NO, Candidate, Record, Register
from ..planning.plan import MiB
from ..planning.probe import CUDA_ERROR_OUT_OF_MEMORY


def _where(record: Record, cand: Candidate) -> str:
    rank = "?" if record.rank is None else record.rank
    return f"rank {rank}" + (f" (cuda:{cand.device})" if cand.device >= 0 else "")


def describe(record: Record, cand: Candidate) -> str:
    """One rank's "no", in words."""
    where = _where(record, cand)
    if cand.reason in (_rec.OUT_OF_MEMORY, _rec.PROBE_ERROR) and cand.failed_bytes:
        err = "CUDA_ERROR_OUT_OF_MEMORY" if cand.cuda_error == CUDA_ERROR_OUT_OF_MEMORY else (
            cand.cuda_error_name or f"CUDA error {cand.cuda_error}")
        what = "the headroom" if cand.failed_headroom else "cuMemCreate"
        free_text = f", {cand.free_bytes / (1 << 30):.2f} GiB free" if cand.free_bytes >= 0 else ""
        return (f"{where}: {what} of {cand.failed_bytes / MiB:.1f} MiB failed: {err}{free_text} "
                f"(plan {cand.peak_bytes / MiB:.1f} MiB + headroom "
                f"{cand.headroom_bytes / MiB:.0f} MiB)")
    return f"{where}: {cand.text()}"


# --------------------------------------------------------------------------- registers
#
# What a deciding rank writes: the register carries the explanation, so every rank's veto
# reads the same whether it read the records or only the register.


def decided(verdict, records: list, by: int, call: str) -> Register:
    """The register of the rank that completed the count and read every record."""
    if verdict.commit:
        return Register("commit", by, "every rank voted yes", call=call, complete=True)
    if verdict.all_pass:
        return Register("pass", by, verdict.why, call=call, complete=True)
    details, named, reasons = [], [], set()
    try:
        from_verdict(verdict, records, [], details, named, reasons)
    except Exception:  # noqa: BLE001 - only for the message: the abort stands
        details = [verdict.why]
    short = shortfalls(verdict, records, None)
    return Register(ABORT, by, verdict.why, check=verdict.check, reasons=tuple(sorted(reasons)),
                    details=tuple(details), named=tuple(sorted({r for r in named
                                                                if isinstance(r, int)})),
                    short=short, call=call, complete=True)


def writers_gone(records: list, positions: list, by: int, call: str) -> Register:
    """The register of a count completed with the yes of a process that no longer runs
    (``process``): a rank killed after its yes, or an earlier job's process on this store.
    Its rank is named absent."""
    named, details = [], []
    for pos in positions:
        rec = records[pos]
        rank = rec.rank if isinstance(rec.rank, int) else pos
        named.append(rank)
        details.append(f"rank {rank}: its yes was written by process {rec.pid}, which no "
                       "longer runs (killed after its vote, or a process of an earlier job "
                       "on this store)")
    return Register(ABORT, by, "; ".join(details), reasons=(_rec.ABSENT,),
                    details=tuple(details), named=tuple(sorted(named)), call=call)
    # (not ``complete``: a gone writer's record says nothing of whether every live rank came,
    # so no leftover is swept on it)


def said_no(record: Record) -> Register:
    """The register a rank that said no writes at once."""
    cands = list(record.candidates.values())
    details = [describe(record, cand) for cand in cands] or [f"rank {record.rank} said no"]
    why = "; ".join(details) or f"rank {record.rank} said no: {record.no_text()}"
    return Register(ABORT, record.rank, why, check=record.failed_check(),
                    reasons=record_reasons(record), details=tuple(details),
                    named=(record.rank,) if isinstance(record.rank, int) else (),
                    short=shortfalls(None, [], record), call=record.call)


def timed_out(rank: int, vote_timeout: float, call: str) -> Register:
    """The register a rank writes at its deadline: ``ABSENT`` (every rank that reads it
    names the ranks whose record is still not in: the driver reads them)."""
    return Register(ABORT, rank, f"rank {rank} reached its deadline ({vote_timeout:g} s) before "
                    "every rank's yes was in", reasons=(_rec.ABSENT,), call=call)


def interrupted(rank: int, why: str, call: str) -> Register:
    return Register(ABORT, rank, f"rank {rank}: {why}", call=call)


def record_reasons(record: Record) -> tuple:
    """The reason codes of one rank's no."""
    return tuple(sorted({c.reason for c in record.candidates.values() if not c.usable}
                        or {_rec.INTERNAL_ERROR}))


def from_verdict(verdict, records, ranks, details: list, named: list, reasons: set) -> None:
    """What a decided abort says: argument mismatches, failed cross-rank checks, every
    rank's no, differing plans (appended to ``details``, ``named`` and ``reasons``)."""
    def rank_of(pos):
        r = records[pos]
        if isinstance(r, Record) and r.rank is not None:
            return r.rank
        return ranks[pos] if pos < len(ranks) else pos

    def holders(by_value) -> list:
        """``"value on rank(s) a, b"`` for each ``(value, positions)``."""
        return [f"{value} on rank{'s' if len(pos) > 1 else ''} "
                f"{', '.join(str(rank_of(p)) for p in pos)}" for value, pos in by_value]

    for name, by_value in verdict.mismatch:
        by_value = dict(sorted(by_value.items(),
                               key=lambda item: min(rank_of(p) for p in item[1])))
        details.append(f"{name} differs: " + "; ".join(holders(by_value.items())))
        reasons.add(_rec.ARG_MISMATCH)
        for pos_list in by_value.values():
            named.extend(rank_of(p) for p in pos_list)
    if verdict.mismatch:
        named[:] = sorted(set(named))
    for failure in verdict.checks:
        parts = holders(failure.by_value)
        label = _rec.REASON_TEXT.get(failure.code, "failed")
        details.append(f"check {failure.check}: {label}: {failure.text}"
                       + (f" ({'; '.join(parts)})" if parts else ""))
        reasons.add(failure.code)
        for _, pos in failure.by_value:
            named.extend(rank_of(p) for p in pos)
    for pos in verdict.no + verdict.passing:
        cand = records[pos].candidates.get(verdict.candidate) or Candidate(
            NO, _rec.INTERNAL_ERROR, f"no {verdict.candidate} candidate")
        details.append(describe(records[pos], cand))
        reasons.add(cand.reason)
        named.append(rank_of(pos))
    for pos in verdict.plan_mismatch:
        details.append(f"rank {rank_of(pos)}: its plan differs from the other ranks' "
                       "(different GPU facts or FlashInfer release)")
        named.append(rank_of(pos))
    if verdict.internal:
        reasons.add(_rec.INTERNAL_ERROR)
    if not details:
        details.append(verdict.why)




def _shortfall(cand: Candidate) -> int:
    """Bytes one rank lacked: its plan plus headroom less its free memory (-1: not known)."""
    if cand.free_bytes < 0:
        return -1
    return max(cand.peak_bytes + cand.headroom_bytes - cand.free_bytes, -1)


def shortfalls(verdict, records, record) -> tuple:
    """``VetoInfo.short`` of a vetoed round: (rank, device, bytes short) of every record
    that said no for lack of memory; from the decided ``verdict`` over ``records`` when
    this rank read them, else from ``record`` (this rank's own no)."""
    try:
        pairs = []
        if verdict is not None and records and not verdict.commit:
            pairs = [(records[p], records[p].candidates.get(verdict.candidate))
                     for p in verdict.no + verdict.passing]
        elif record is not None and not record.is_yes():
            pairs = [(record, cand) for cand in record.candidates.values()]
        found = [(rec.rank, cand.device, _shortfall(cand)) for rec, cand in pairs
                 if cand is not None and cand.reason == _rec.OUT_OF_MEMORY
                 and isinstance(rec.rank, int)]
        first = {}  # one entry per rank (``auto`` has two candidates)
        for entry in found:
            first.setdefault(entry[0], entry)
        return tuple(first.values())
    except Exception:  # noqa: BLE001 - only for the headline, which then names no figure
        return ()


