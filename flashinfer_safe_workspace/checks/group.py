"""Mode 1: the group FlashInfer will rendezvous on against the call's ranks.

``world_size``/``rank`` against the rank set the shim votes on (all releases), and, on
the torch symmetric-memory paths (allocator C: 0.6.10–0.6.14 every backend, the legacy
function without ``use_symm_dev_mem``, trtllm under confidential computing from 0.6.16),
the group FlashInfer itself rendezvouses on: ``group=`` or WORLD, not the comm backend's
group (mnnvl 0.6.10–0.6.14: the comm backend's group only for a ``TorchDistBackend``).
"""

from __future__ import annotations

from .. import _reasons as R
from ..agreement import group as _group
from .base import fail, ok

NAME = "group"
CODE = R.RENDEZVOUS_GROUP
MODES = (1,)
RELEASES = ("arguments vs group: every release; rendezvous group: allocator C "
            "(0.6.10–0.6.14 all backends, legacy non-symm 0.6.10+, CC trtllm 0.6.16+)")


def applies(ctx) -> bool:
    return ctx.members.label != _group.NO_PROCESS_GROUP


def _rendezvous_group(ctx):
    """(label, group) FlashInfer's symmetric-memory rendezvous uses, or None."""
    if ctx.allocator != "C":
        return None
    backend = ctx.bound.get("comm_backend")
    if ctx.backend == "mnnvl":
        if backend is not None and type(backend).__name__ == "TorchDistBackend":
            return None  # the comm backend's own group: the rank set already
        return "WORLD", None
    group = ctx.bound.get("group")
    return ("group", group) if group is not None else ("WORLD", None)


def group_mismatch(req, members: _group.Members) -> str:
    """What the call's ``world_size``/``rank`` say against the rank set the shim votes on
    (``""``: they agree, or there is no process group to compare with)."""
    if members.label == _group.NO_PROCESS_GROUP:
        return ""
    if isinstance(req.world_size, int) and req.world_size != members.size:
        return (f"world_size={req.world_size} but the group FlashInfer will use ({members.label}) "
                f"has {members.size} ranks {list(members.ranks)}")
    if isinstance(req.rank, int) and req.rank != members.me:
        return f"rank={req.rank} but this process is rank {members.me} of {members.label}"
    return ""


def local(ctx):
    mismatch = group_mismatch(ctx.req, ctx.members)
    if mismatch:
        return fail(R.ARG_MISMATCH, f"ranks={ctx.members.size}", mismatch)
    found = _rendezvous_group(ctx)
    if found is None or not _group.initialised():
        return ok(f"ranks={ctx.members.size}")
    label, group = found
    import torch.distributed as dist

    size = int(dist.get_world_size(group))
    me = int(dist.get_rank(group))
    value = f"rendezvous={label} size={size} world_size={ctx.req.world_size}"
    if size != ctx.req.world_size or (isinstance(ctx.req.rank, int) and me != ctx.req.rank):
        return fail(R.RENDEZVOUS_GROUP, value,
                    f"FlashInfer {ctx.version} rendezvouses on {label} ({size} ranks, this "
                    f"rank {me}) while the call is for {ctx.req.world_size} ranks "
                    f"{list(ctx.members.ranks)}: it would wait for ranks that never come")
    return ok(value)
