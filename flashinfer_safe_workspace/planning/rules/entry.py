"""THE entry point of the rules: :func:`plan_for` (request, facts, version) -> plan."""

from __future__ import annotations

from typing import Union

from ..plan import Facts, PassThrough, Plan, Request, Unplanned
from .common import check_ints
from .cutedsl import cutedsl_workspace
from .mnnvl import mnnvl_workspace
from .trtllm import trtllm_workspace
from .versions import Traits, traits


def _resolve_auto(t: Traits, req: Request, facts: Facts) -> Union[str, PassThrough]:
    if not t.auto_vote:
        return "mnnvl"  # 0.6.0–0.6.15: mnnvl is always "suitable" and preferred
    mc = facts.multicast_all_ranks
    if mc is None or req.world_size <= 1:
        mc = facts.multicast_supported
    if mc:
        return "mnnvl"
    if req.world_size <= 16:
        return "trtllm"
    return PassThrough("no suitable backend (FlashInfer ValueError)")


def plan_for(req: Request, facts: Facts, version: str) -> Union[Plan, PassThrough]:
    """What one rank's creation call ``req`` allocates under FlashInfer ``version``,
    on a device and runtime described by ``facts`` (see ``_facts.runtime_facts``).

    Returns a :class:`Plan`, or a :class:`PassThrough` when FlashInfer rejects the
    arguments itself before allocating. Raises :class:`Unplanned` when no rule covers
    the request (our limitation), e.g. a version older than 0.5.0."""
    t = traits(version)
    if req.entry == "legacy":
        if t.legacy_symm is None and (req.use_symm_dev_mem or req.has_comm_backend):
            return PassThrough("0.5.x has no use_symm_dev_mem/comm_backend parameter "
                               "(FlashInfer TypeError)")
        if req.use_symm_dev_mem and not req.create_metadata:
            return PassThrough("use_symm_dev_mem needs create_metadata=True (FlashInfer ValueError)")
        bad = check_ints(req, "world_size", "max_token_num", "hidden_dim")
        if bad is not None:
            return bad
        allocator = t.legacy_symm if req.use_symm_dev_mem else t.legacy_default
        return trtllm_workspace(t, req, facts, version, allocator, "legacy")
    if req.entry != "unified":
        raise Unplanned(f"unknown entry {req.entry!r}")
    if not t.unified:
        return PassThrough("this release has no create_allreduce_fusion_workspace")

    backend = req.backend
    if req.cutedsl_options and not t.cutedsl_factory:
        return PassThrough("keyword-only mnnvl-cutedsl options do not exist in this "
                           "release (FlashInfer TypeError)")
    if backend == "mnnvl-cutedsl" and t.cutedsl_factory:
        bad = check_ints(req, "world_size", "max_token_num", "hidden_dim")
        if bad is not None:
            return bad
        return cutedsl_workspace(t, req, facts, version)
    if t.cutedsl_factory and req.cutedsl_options:
        return PassThrough("mnnvl-cutedsl options given to another backend (FlashInfer ValueError)")
    if backend not in ("trtllm", "mnnvl", "auto"):
        return PassThrough(f"unknown backend {backend!r}; FlashInfer raises RuntimeError")
    bad = check_ints(req, "world_size", "max_token_num", "hidden_dim")
    if bad is not None:
        return bad
    if backend == "auto":
        resolved = _resolve_auto(t, req, facts)
        if isinstance(resolved, PassThrough):
            return resolved
        backend = resolved
    cc = t.confidential_compute and facts.confidential_compute
    if backend == "trtllm":
        allocator = "C" if cc else t.trtllm  # CC: use_symm_dev_mem=False, i.e. C
        return trtllm_workspace(t, req, facts, version, allocator, "unified")
    if cc:
        return PassThrough("mnnvl under confidential compute (FlashInfer ValueError)")
    return mnnvl_workspace(t, req, facts, version)


def needs_group_multicast_vote(req: Request, version: str) -> bool:
    """Whether ``auto`` is resolved by a group-wide multicast vote in this release."""
    return req.entry == "unified" and req.backend == "auto" and traits(version).auto_vote
