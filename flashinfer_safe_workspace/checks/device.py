"""Mode 2: the device the release allocates on against the current device.

0.6.0–0.6.6 allocate the trtllm workspace on ``cuda:<tp_rank>`` and the mnnvl one on
``cuda:<rank % gpus_per_node>`` (and switch the current device there); 0.6.7 uses the
current device. A rank whose index differs raises or lands on another GPU."""

from __future__ import annotations

from .. import _reasons as R
from .base import fail, ok

NAME = "device"
CODE = R.DEVICE_MISMATCH
MODES = (2,)
RELEASES = "0.6.0–0.6.6 (trtllm: tp_rank; mnnvl/auto: rank % gpus_per_node)"


def _planned(ctx):
    t, req = ctx.traits, ctx.req
    if t is None or not isinstance(req.rank, int):
        return None
    if req.entry == "legacy":
        return req.rank if (req.use_symm_dev_mem and t.trtllm_device_is_rank) else None
    if ctx.backend == "trtllm" and t.trtllm_device_is_rank:
        return req.rank
    if ctx.backend in ("mnnvl", "auto") and t.mnnvl_device_is_local_rank:
        per_node = req.gpus_per_node or min(ctx.facts().device_count, int(req.world_size or 1))
        return req.rank % max(int(per_node), 1)
    return None


def applies(ctx) -> bool:
    return _planned(ctx) is not None


def local(ctx):
    planned, current = _planned(ctx), ctx.facts().device
    value = f"planned=cuda:{planned} current=cuda:{current}"
    if planned != current:
        return fail(R.DEVICE_MISMATCH, value,
                    f"FlashInfer {ctx.version} allocates on cuda:{planned}, not on the current "
                    f"device cuda:{current} (fixed in 0.6.7)")
    return ok(value)
