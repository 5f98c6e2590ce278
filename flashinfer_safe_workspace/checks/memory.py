"""Mode 12: the plan for this release, probed with cuMemCreate (plus the headroom).

The plan and the probe (``planning``); this module turns them into the rank's
candidates (``auto`` has two: with and without multicast on every rank)."""

from __future__ import annotations

import dataclasses

from .. import _points, _reasons as R
from .._log import internal_error
from ..agreement.record import NO, PASS_STATE, YES, Candidate, CheckResult
from ..audit import compare as _audit
from ..planning import probe as _probe, request as _request
from ..planning.plan import PassThrough, Unplanned

NAME = "memory"
CODE = R.OUT_OF_MEMORY
MODES = (12,)
RELEASES = "every release and path"


def no(ok: bool, reason: int, note: str = "", **fields) -> Candidate:
    """A candidate that failed for ``reason`` (``ok``: FAIL_OPEN turns it into a yes)."""
    return Candidate(YES if ok else NO, int(reason), str(note)[:300], **fields)


def candidates(req, version, facts, settings, headroom, auto: bool):
    """``({name: Candidate}, plan of the first candidate or None)``."""
    variants = {"nomc": False, "mc": True} if auto else {"-": None}
    if auto and not facts.multicast_supported:
        del variants["mc"]
    cands, first = {}, None
    for name, everyone in variants.items():
        cand, plan = candidate(req, version, facts, everyone, auto, settings, headroom)
        cands[name] = cand
        if plan is not None and first is None:
            first = plan
    return cands, first


def result(cands: dict) -> CheckResult:
    """The memory check's entry in the record, from the candidates."""
    bad = [c for c in cands.values() if c.state == NO]
    top = bad[0] if bad else next(iter(cands.values()), None)
    if top is None:
        return CheckResult(True, R.OK, "")
    value = f"plan={top.peak_bytes} headroom={top.headroom_bytes} free={top.free_bytes}"
    return CheckResult(not bad, top.reason if bad else R.OK, value, top.note if bad else "")


def candidate(req, version, facts, everyone, auto, settings, headroom):
    """``(Candidate, Plan or None)`` for one way of creating the workspace."""
    if auto:
        facts = dataclasses.replace(facts, multicast_all_ranks=everyone)
    try:
        plan = _request.plan_for(req, facts, version)
    except Unplanned as exc:
        internal_error("plan", exc)
        return no(settings.fail_open, R.UNPLANNED, str(exc)), None
    except Exception as exc:  # noqa: BLE001 - our bug
        internal_error("plan", exc)
        return no(settings.fail_open, R.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"), None
    if isinstance(plan, PassThrough):
        return Candidate(PASS_STATE, R.PASS_THROUGH, plan.reason[:300], plan_digest=plan.reason), None
    base = {"plan_digest": str(plan.digest()), "peak_bytes": plan.peak_bytes,
            "headroom_bytes": headroom, "backend": plan.backend}
    try:  # what an earlier creation of this call really took, if more than planned
        probed = _audit.apply_floor(plan, _request.identity(req))
    except Exception as exc:  # noqa: BLE001
        internal_error("audit.floor", exc)
        probed = plan
    _points.hit("probe")
    try:
        res = _probe.get_prober().probe(probed, headroom)
    except _probe.ProbeUnavailable as exc:
        internal_error("probe.unavailable", exc)
        return no(settings.fail_open, R.NO_DEVICE, str(exc), **base), plan
    except Exception as exc:  # noqa: BLE001 - the driver surprising us, or our bug
        internal_error("probe", exc)
        return no(settings.fail_open, R.PROBE_ERROR, f"{type(exc).__name__}: {exc}", **base), plan
    failed = res.failed
    return no(res.ok, res.reason, failed.name, device=res.device, free_bytes=res.free_bytes,
              failed_bytes=failed.size, cuda_error=int(failed.cuda_error or 0),
              cuda_error_name=str(failed.cuda_error_name or ""),
              failed_headroom=failed.name == "headroom",
              probe_ms=round(res.elapsed_s * 1000, 3), **base), plan
