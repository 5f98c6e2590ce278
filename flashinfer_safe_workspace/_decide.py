"""Decide one creation call: arguments -> rank set -> plan and probe -> one round -> answer.

The flow only; the pieces live elsewhere: the call's arguments (``_request``), the ranks
(``_group``), facts and plans (``_facts``, rules), the probe (``_probe``), the round and
its register (``_vote``), the veto messages (``_explain``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Optional

from . import (_allgather, _audit, _config, _explain, _group, _probe, _request, _round, _store,
               _vote)
from ._explain import VetoInfo
from ._log import internal_error, logger, rank_tag
from . import _plan
from ._plan import PassThrough, Plan, Unplanned

UNIFIED, LEGACY = _request.UNIFIED, _request.LEGACY

_veto_cache: dict = {}  # (entry, ranks, identity) -> VetoInfo, from decided rounds
_fast: dict = {}  # exact hashable call -> the workspace key above
_cache_lock = threading.Lock()
_version_warned: set = set()


@dataclasses.dataclass
class Decision:
    """What the wrapper does: ``call`` the original, or ``veto``."""

    action: str  # "call" | "veto"
    reason: str = ""
    veto: Optional[VetoInfo] = None
    plan: Optional[Plan] = None
    members: Optional[_group.Members] = None
    request: object = None
    identity: str = ""
    free_bytes: int = -1
    device: int = -1
    headroom_bytes: int = 0
    headroom_why: str = "-"
    probe_ok: Optional[bool] = None
    elapsed_ms: float = 0.0
    logged: bool = False  # a decision line is due (a real round or local decision ran)
    version: Optional[str] = None
    granularity: Optional[int] = None
    cached: bool = False

    @property
    def voted(self) -> tuple:
        return self.members.ranks if self.members is not None else ()


# --------------------------------------------------------------------------- cache


def cached_veto(entry: str, original: Callable, args: tuple, kwargs: dict):
    """A veto this call already got from a decided round, or None. The exact-call key is
    tried first (microseconds); then the workspace key (entry, ranks, identity), which does
    not depend on per-call objects such as a fresh comm_backend."""
    try:
        fast = (entry, id(original), args, tuple(sorted(kwargs.items())))
        hash(fast)
    except Exception:  # noqa: BLE001 - unhashable (or a hostile __eq__/__hash__)
        fast = None
    if fast is not None:
        wkey = _fast.get(fast)
        if wkey is not None and wkey in _veto_cache:
            return _veto_cache[wkey], wkey
    return None, fast


def _remember(wkey, fast, info: VetoInfo) -> None:
    with _cache_lock:
        _veto_cache[wkey] = info
        if fast is not None:
            _fast[fast] = wkey


def clear_cache() -> None:
    with _cache_lock:
        _veto_cache.clear()
        _fast.clear()


def _after_fork_in_child():
    global _cache_lock
    _cache_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- the flow


def decide(entry: str, original: Callable, args: tuple, kwargs: dict,
           settings: _config.Settings, fast=None) -> Decision:
    """Everything before FlashInfer runs. Our own failures become this rank's "no"."""
    start = time.perf_counter()
    deadline = time.monotonic() + settings.vote_timeout
    req, bound = _request.build(entry, original, args, kwargs)
    if req is None:  # FlashInfer will raise its own TypeError: tell the peers first
        members = _group.guess_members(kwargs)
        if members is not None and members.kind == "store":
            _tell_peers_no(members, _request.record_for_unbound(members), deadline, settings)
        return Decision("call", "arguments do not bind; FlashInfer reports its own error")
    ident = _request.identity(req)
    try:
        members = _group.members_for(group=bound.get("group"), comm_backend=bound.get("comm_backend"),
                                     uses_comm_backend=_request.uses_comm_backend(req))
    except _group.ForkedChild as exc:  # FlashInfer would wait forever here: never call it
        return Decision("veto", "forked child", _explain.local(str(exc)))
    except Exception as exc:  # noqa: BLE001 - e.g. not a member of the group it names
        internal_error("group", exc)
        if settings.fail_open:
            return Decision("call", f"no rank set ({exc}); fail-open")
        return Decision("veto", "no rank set", _explain.local(
            f"could not tell which ranks create this workspace: {type(exc).__name__}: {exc}"))
    wkey = (entry, members.ranks, members.kind, ident)
    hit = _veto_cache.get(wkey)
    if hit is not None:
        if fast is not None:
            _remember(wkey, fast, hit)
        return Decision("veto", "cached veto", hit, members=members, request=req, cached=True)
    if _probe.capturing():
        return Decision("call", "called during CUDA graph capture: no probe, FlashInfer decides")
    if members.kind == "local" and _request.needs_process_group(req, members):
        return Decision("call", "torch.distributed is not initialised and no comm_backend is "
                        "given: FlashInfer raises its own error before allocating")
    version = _request.flashinfer_version()
    if _request.unknown_version(version) and settings.unknown_version == "pass-through":
        _warn_version(version, settings)
        return Decision("call", f"FlashInfer {version} not mirrored; pass-through (unprotected)")

    decision = Decision("veto", members=members, request=req, identity=ident, logged=True)
    lock = (_vote.set_lock(members.kind + ":" + _vote.members_key(members.ranks))
            if members.kind != "local" else None)
    if lock is not None and not lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
        info = _explain.local(f"another thread of this process was still deciding for ranks "
                              f"{list(members.ranks)} when the vote timeout ran out")
        decision.veto, decision.reason = info, info.message
        return decision  # not cached: the peers may have decided either way without us
    try:
        return _decide_round(decision, req, bound, ident, version, members, settings,
                             deadline, start, wkey, fast)
    finally:
        if lock is not None:
            lock.release()


def _decide_round(decision, req, bound, ident, version, members, settings, deadline, start,
                  wkey, fast):
    rnd = _round_for(members, ident, deadline, settings, _request.summary(req))
    record = None
    try:
        early = rnd.open()
        if early is not None:  # the group already decided this call without us: follow
            outcome = early
        else:
            record = _local_record(req, bound, version, members, settings, decision)
            outcome = rnd.vote(record)
    except (_store.StoreTimeout, _store.StoreUnavailable) as exc:
        rnd.abort_now(f"store: {exc}")
        outcome = _vote.Outcome(False, missing=f"the c10d store did not answer: {exc}",
                                in_doubt=True)
    except Exception as exc:  # noqa: BLE001 - our bug, or the store surprising us
        internal_error("vote", exc)
        rnd.abort_now(f"internal error: {exc}")
        outcome = _vote.Outcome(False, missing=f"internal error: {type(exc).__name__}: {exc}",
                                in_doubt=True)
    except BaseException:  # KeyboardInterrupt, SystemExit: abort first, then let it through
        rnd.abort_now("interrupted")
        raise
    decision.elapsed_ms = (time.perf_counter() - start) * 1000
    if outcome.register.get("o") == _vote.PASS:  # every rank: FlashInfer rejects it itself
        decision.action, decision.logged = "call", False
        decision.reason = "FlashInfer rejects these arguments on every rank"
        return decision
    if outcome.commit:
        decision.action, decision.reason = "call", "every rank voted yes"
        return decision
    info = _explain.veto(outcome, members, decision.plan, record)
    decision.veto, decision.reason = info, info.message
    if not outcome.in_doubt:  # a decided register: the same answer on every rank
        _remember(wkey, fast, info)
    return decision


def _tell_peers_no(members, record, deadline, settings) -> None:
    """Publish this rank's "no" for a call it cannot decide (bounded; errors are ours)."""
    rnd = _round_for(members, record["id"], deadline, settings, record["args"])
    try:
        if rnd.open() is None:
            rnd.vote(record)
    except Exception as exc:  # noqa: BLE001
        internal_error("vote.unbound", exc)
        rnd.abort_now("arguments do not bind")
    except BaseException:
        rnd.abort_now("interrupted")
        raise


def _round_for(members, ident, deadline, settings, args=None):
    if members.kind == "store":
        rnd = _round.StoreRound(_store.line(settings.vote_timeout), members.ranks, members.me,
                                ident, deadline, members.label, args)
        rnd.line_timeout = settings.vote_timeout
        return rnd
    if members.kind == "allgather":
        return _allgather.AllgatherRound(members.comm, members.size, members.me, ident, deadline,
                                    members.label)
    return _vote.LocalRound(members.label)


def _warn_version(version, settings):
    if version not in _version_warned:
        _version_warned.add(version)
        logger.warning("flashinfer_safe_workspace %s: FlashInfer %s is newer than the newest "
                       "release mirrored (%s); UNKNOWN_VERSION=%s", rank_tag(), version,
                       _request.newest(), settings.unknown_version)


# --------------------------------------------------------------------------- this rank


def _local_record(req, bound, version, members, settings, decision: Decision) -> dict:
    """This rank's record: plan and probe every candidate; never raises for our errors."""
    record = _request.base_record(req, members)
    mismatch = _request.group_mismatch(req, members)
    if _request.unknown_version(version):
        _warn_version(version, settings)
        if settings.unknown_version == "veto":
            record["c"] = {"-": _cand(False, _vote.UNKNOWN_VERSION,
                                      f"FlashInfer {version} not mirrored; UNKNOWN_VERSION=veto")}
            return record
    try:  # arguments FlashInfer rejects before allocating: no device work at all
        early = _request.plan_for(req, _plan.Facts(), version)
    except Exception:  # noqa: BLE001 - the full path below reports it
        early = None
    if isinstance(early, PassThrough):
        record["c"] = {"-": {"s": "pass", "r": _vote.PASS_THROUGH, "n": early.reason}}
        return record
    headroom, why = _request.headroom(settings, req, bound)
    decision.headroom_bytes, decision.headroom_why = headroom, why
    try:
        facts = _request.facts_for(req, members)
    except Exception as exc:  # noqa: BLE001 - a driver query that fails is a "no"
        code = _vote.NO_DEVICE if isinstance(exc, _probe.ProbeUnavailable) else _vote.DRIVER_ERROR
        internal_error("facts", exc)
        record["c"] = {"-": _cand(settings.fail_open, code, f"{type(exc).__name__}: {exc}")}
        return record
    decision.version, decision.granularity = version, facts.granularity
    auto = _request.auto_by_vote(req, version)
    record["auto"] = auto
    record["mc"] = bool(facts.multicast_supported)
    variants = {"-": None}
    if auto:
        variants = {"nomc": False}
        if facts.multicast_supported:
            variants["mc"] = True
    cands = {}
    for name, everyone in variants.items():
        cand = _candidate(req, version, facts, everyone, auto, members, settings, headroom,
                          mismatch)
        cands[name] = cand
        if cand.get("plan") is not None and (name in ("-", "nomc") or decision.plan is None):
            decision.plan = cand["plan"]
        if cand.get("dev", -1) >= 0:
            decision.device, decision.free_bytes = cand["dev"], cand.get("free", -1)
            decision.probe_ok = cand["s"] == "ok"
    for cand in cands.values():
        cand.pop("plan", None)
    record["c"] = cands
    return record


def _cand(ok: bool, reason: int, note: str = "", **numbers) -> dict:
    return {"s": "ok" if ok else "no", "r": int(reason), "n": str(note)[:300], **numbers}


def _candidate(req, version, facts, everyone, auto, members, settings, headroom, mismatch):
    if auto:
        facts = dataclasses.replace(facts, multicast_all_ranks=everyone)
    try:
        plan = _request.plan_for(req, facts, version)
    except Unplanned as exc:
        internal_error("plan", exc)
        return _cand(settings.fail_open, _vote.UNPLANNED, str(exc))
    except Exception as exc:  # noqa: BLE001 - our bug
        internal_error("plan", exc)
        return _cand(settings.fail_open, _vote.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
    if isinstance(plan, PassThrough):
        return {"s": "pass", "r": _vote.PASS_THROUGH, "n": plan.reason, "d": plan.reason}
    base = {"d": str(plan.digest()), "peak": plan.peak_bytes, "head": headroom,
            "backend": plan.backend, "plan": plan}
    if mismatch:
        return dict(_cand(False, _vote.ARG_MISMATCH, mismatch), **base)
    try:  # what an earlier creation of this call really took, if more than planned
        probed = _audit.apply_floor(plan, _request.identity(req))
    except Exception as exc:  # noqa: BLE001
        internal_error("audit.floor", exc)
        probed = plan
    try:
        result = _probe.get_prober().probe(probed, headroom)
    except _probe.ProbeUnavailable as exc:
        internal_error("probe.unavailable", exc)
        return dict(_cand(settings.fail_open, _vote.NO_DEVICE, str(exc)), **base)
    except Exception as exc:  # noqa: BLE001 - the driver surprising us, or our bug
        internal_error("probe", exc)
        return dict(_cand(settings.fail_open, _vote.PROBE_ERROR, f"{type(exc).__name__}: {exc}"),
                    **base)
    reason = _vote.OK if result.ok else (_vote.OUT_OF_MEMORY if result.reason == 1
                                          else _vote.PROBE_ERROR)
    return dict(_cand(result.ok, reason, result.failed_name, dev=result.device,
                      free=result.free_bytes, fail=result.failed_bytes, err=result.cuda_error,
                      errn=result.cuda_error_name, fh=int(result.failed_name == "headroom"),
                      ms=round(result.elapsed_s * 1000, 3)), **base)
