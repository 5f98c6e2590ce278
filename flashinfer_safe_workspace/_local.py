"""This rank's record for one decision: the plan, the facts, the checks and the probe,
run under the call's deadline (``_bounded``).

A step that has not returned a little before the deadline is this rank's "no", naming the
step (``STEP_TIMEOUT``), so the rank answers within the vote timeout like its peers. The
step goes on in the background on its rank set's worker: its probe allocations are
released on its own path, and what it finds goes to a scratch copy of the decision that
nobody reads. The next call on the set waits for it, bounded by its own deadline.
"""

from __future__ import annotations

import dataclasses
import os
import time

from . import _bounded, _reasons as R
from . import checks as _checks
from ._log import internal_error, logger, rank_tag
from .agreement import group as _group
from .agreement import process as _process
from .agreement.record import NO, PASS_STATE, YES, Candidate, CheckResult, Record
from .checks import deep as _deep, exchange as _exchange, memory as _memory
from .planning import plan as _plan, probe as _probe, request as _request
from .planning.plan import PassThrough

_version_warned: set = set()
# what the record's steps tell the decision line; copied from the scratch copy on time only
_SEEN = ("headroom_bytes", "headroom_why", "version", "granularity", "plan", "device",
         "free_bytes", "probe_ok")


def record(call, decision, set_key: str) -> Record:
    """This rank's record, or its "no" naming the step still running at the deadline
    (less a margin of a tenth of the vote timeout, at most 0.5 s, to publish it)."""
    scratch, progress = dataclasses.replace(decision), _bounded.Progress("the plan")
    until = call.deadline - min(0.5, call.settings.vote_timeout / 10)
    try:
        mine = _bounded.worker(set_key).run(lambda: _local_record(call, scratch, progress),
                                            progress, until)
    except _bounded.Late as late:
        return late_record(call, late)
    for name in _SEEN:
        setattr(decision, name, getattr(scratch, name))
    return mine


def late_record(call, late: "_bounded.Late") -> Record:
    """The "no" of a rank whose step had not returned (named as a failed check where the
    step was one, so the decision line names it too; ``applies=False``: it read no fact
    that the cross-rank comparison could hold against the peers')."""
    text = f"{late} within the vote timeout ({call.settings.vote_timeout:g} s)"
    name = late.step[len("check "):] if late.step.startswith("check ") else ""
    checks = {name: CheckResult(False, R.STEP_TIMEOUT, f"check={name}", text, applies=False)
              } if name else {}
    cand = _memory.no(False, R.STEP_TIMEOUT, text)
    return base_record(call.req, call.members, checks=checks,
                       candidates={n: cand for n in ("-", "mc", "nomc")})


def warn_version(version, settings):
    if version not in _version_warned:
        _version_warned.add(version)
        logger.warning("flashinfer_safe_workspace %s: FlashInfer %s is %s; "
                       "UNKNOWN_VERSION=%s", rank_tag(), version,
                       _request.unverified_why(version), settings.unknown_version)


def base_record(req, members, **fields) -> Record:
    return Record(rank=_group.global_rank(), pid=os.getpid(), position=members.me,
                  call=_request.identity(req), args=_request.summary(req),
                  proc=_process.identity(), at=time.time(), **fields)


def unbound_record(members) -> Record:
    """The "no" of a rank whose arguments do not bind (its FlashInfer call raises)."""
    return Record(rank=_group.global_rank(), pid=os.getpid(), position=members.me,
                  call="unbound", args={"arguments": "do not bind"},
                  candidates={"-": Candidate(NO, R.PASS_THROUGH,
                                             "its arguments do not bind to FlashInfer's signature")})


def _local_record(call, decision, progress) -> Record:
    """This rank's record: the checks, then plan and probe; never raises for our errors."""
    req, members, settings, version = call.req, call.members, call.settings, call.version
    if _request.unknown_version(version):
        warn_version(version, settings)
        if settings.unknown_version == "veto":
            return base_record(req, members, candidates={"-": _memory.no(
                False, R.UNKNOWN_VERSION, f"FlashInfer {version} not mirrored; UNKNOWN_VERSION=veto")})
    progress.step = "the plan"
    try:  # arguments FlashInfer rejects before allocating: no device work at all
        early = _request.plan_for(req, _plan.Facts(), version)
    except Exception:  # noqa: BLE001 - the full path below reports it
        early = None
    if isinstance(early, PassThrough):
        return base_record(req, members, candidates={
            "-": Candidate(PASS_STATE, R.PASS_THROUGH, early.reason[:300])})
    headroom, why = _request.headroom(settings, req, call.bound)
    decision.headroom_bytes, decision.headroom_why = headroom, why
    progress.step = "the facts"
    try:
        facts = _request.facts_for(req, members)
    except Exception as exc:  # noqa: BLE001 - a driver query that fails is a "no"
        code = R.NO_DEVICE if isinstance(exc, _probe.ProbeUnavailable) else R.DRIVER_ERROR
        internal_error("facts", exc)
        return base_record(req, members, candidates={"-": _memory.no(
            settings.fail_open, code, f"{type(exc).__name__}: {exc}")})
    decision.version, decision.granularity = version, facts.granularity
    auto = _request.auto_by_vote(req, version)
    results, failed = _run_checks(call, facts, progress)
    if failed is not None:
        name, res = failed
        cand = _memory.no(res.ok, res.code, f"check {name}: {res.text()}")
        names = ("nomc", "mc") if auto else ("-",)
        return base_record(req, members, candidates={n: cand for n in names}, auto=auto,
                            multicast=bool(facts.multicast_supported), checks=results)
    progress.step = "the plan and probe"
    cands, plan = _memory.candidates(req, version, facts, settings, headroom, auto)
    decision.plan = plan
    for cand in cands.values():
        if cand.device >= 0:
            decision.device, decision.free_bytes = cand.device, cand.free_bytes
            decision.probe_ok = cand.state == YES
    results[_memory.NAME] = _memory.result(cands)
    return base_record(req, members, candidates=cands, auto=auto,
                        multicast=bool(facts.multicast_supported), checks=results)


def _run_checks(call, facts, progress):
    """``({name: CheckResult}, first failure or None)``: the local checks, then the deep
    probe where it is switched on (every rank takes part or says it skips)."""
    try:
        rank = _probe.get_prober().rank_facts()
        facts_error = ""
    except Exception as exc:  # noqa: BLE001 - each check that needs them fails closed
        internal_error("rank_facts", exc)
        rank, facts_error = None, f"this rank's facts could not be read: {type(exc).__name__}: {exc}"
    ctx = _checks.Context(call.req, call.version or "", _checks.traits_for(call.version),
                          call.members, call.settings, call.bound, rank,
                          cc=bool(facts.confidential_compute),
                          extra={"facts_error": facts_error,
                                 "left_s": call.deadline - time.monotonic(),
                                 "exchange": _exchange_for(call), "prober": _probe.get_prober()})
    results = {}
    for check in _checks.LOCAL:  # one at a time: a check still running is named
        progress.step = f"check {check.NAME}"
        results[check.NAME] = _checks.run_one(check, ctx)
    failed = _checks.first_failure(results)
    progress.step = f"check {_deep.NAME}"
    try:
        if _deep.applies(ctx):
            res = _deep.run(ctx, take_part=failed is None)
            if res is not None:
                results[_deep.NAME] = res
    except Exception as exc:  # noqa: BLE001 - fail closed
        internal_error("check.deep", exc)
        results[_deep.NAME] = CheckResult(call.settings.fail_open, R.CHECK_ERROR, "check=deep",
                                          f"{type(exc).__name__}: {exc}"[:300])
    return results, _checks.first_failure(results)



def _exchange_for(call):
    """The deep probe's exchange, keyed by this call's store round (None without one),
    bounded by the round: its deadline less twice the margin the record keeps for the vote
    (the plan and probe still run after it, and a peer that never came must still be seen
    absent by the vote, not blamed on this check)."""
    if call.members.kind != "store" or not call.round_key:
        return None
    until = call.deadline - 2 * min(0.5, call.settings.vote_timeout / 10)
    return _exchange.for_round(call.round_key, "deep", call.members.ranks, call.members.me,
                               call.settings.vote_timeout, until)
