"""Builders for the fast layer (``tests/unit``): a check's context, a rank's facts, a
rank's record. Plain values, no processes, no store, no device."""

from __future__ import annotations

import dataclasses
import types

from flashinfer_safe_workspace import checks
from flashinfer_safe_workspace.agreement.group import NO_PROCESS_GROUP, Members
from flashinfer_safe_workspace.agreement.record import YES, Candidate, CheckResult, Record
from flashinfer_safe_workspace.planning.plan import Request
from flashinfer_safe_workspace.planning.rankfacts import Fabric, RankFacts

CLUSTER = "ab" * 16
PACKAGES = (("flashinfer-python", "0.7.4"), ("flashinfer-cubin", ""),
            ("flashinfer-jit-cache", ""))


def settings(**over):
    """The settings a check reads (fail_open, deep_probe, vote_timeout)."""
    base = dict(fail_open=False, deep_probe=False, vote_timeout=10.0)
    base.update(over)
    return types.SimpleNamespace(**base)


def rank_facts(**over) -> RankFacts:
    """A healthy H200-like rank: multicast, one host, no fabric info, no capture."""
    base = dict(host="h1/boot", gpu_uuid="GPU-0", device=0, device_count=8, multicast=True,
                fabric_handles=False, fabric=None, imex_channel=False, capturing=False,
                packages=PACKAGES)
    base.update(over)
    return RankFacts(**base)


def fabric(state=Fabric.COMPLETED, status=0, cluster=CLUSTER) -> Fabric:
    return Fabric(state, status, cluster)


def ctx(backend="trtllm", version="0.7.4", *, entry="unified", rank=0, world=2, me=None,
        size=None, label="test", facts=None, cc=False, bound=None, sett=None, symm=False,
        gpus_per_node=None, kind="store", **fact_over) -> checks.Context:
    """The context one check reads on one rank (``facts=False``: unreadable facts)."""
    req = Request(entry, backend, world, rank, 2048, 4096, "bfloat16",
                  gpus_per_node=gpus_per_node, use_symm_dev_mem=symm)
    n = world if size is None else size
    members = Members(kind, tuple(range(n)), rank if me is None else me, label)
    if facts is False:
        rf = None
    else:
        rf = facts if facts is not None else rank_facts(**fact_over)
    return checks.Context(req, version, checks.traits_for(version), members,
                          sett or settings(), dict(bound or {}), rf, cc=cc)


def no_group(**kw) -> checks.Context:
    return ctx(label=NO_PROCESS_GROUP, **kw)


def record(pos=0, *, call="c", args=None, state=YES, digest="d", cands=None, auto=False,
           multicast=False, checks_=None, **cand_over) -> Record:
    """One rank's record: one candidate ``-`` (or ``cands``), and its check results."""
    if cands is None:
        cands = {"-": Candidate(state, plan_digest=digest, **cand_over)}
    return Record(rank=pos, pid=100 + pos, position=pos, call=call, args=dict(args or {}),
                  candidates=dict(cands), auto=auto, multicast=multicast,
                  checks=dict(checks_ or {}))


def with_check(name, value, ok=True, code=0, applies=True) -> dict:
    return {name: CheckResult(ok, code, value, "", applies=applies)}


def replace(obj, **kw):
    return dataclasses.replace(obj, **kw)
