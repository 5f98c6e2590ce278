"""The mnnvl workspace (unified ``backend="mnnvl"``, and ``auto`` where it resolves to it)."""

from __future__ import annotations

from typing import Union

from ..plan import Allocation, Facts, PassThrough, Plan, Request, round_up
from .allocators import b_alloc, c_alloc
from .common import element_size, is_int
from .versions import Traits

MNNVL_ONE_SHOT_THRESHOLD = 64 * 1024 * 8 * 2
MNNVL_MAX_BUFFER = 2**32 - 1  # UINT32_MAX: larger mnnvl buffers are a ValueError


def mnnvl_buffer(t: Traits, req: Request) -> tuple:
    """One Lamport buffer's bytes (FlashInfer allocates three of them at once)."""
    ws, tokens, h = req.world_size, req.max_token_num, req.hidden_dim
    e = element_size(req.dtype)
    if req.force_oneshot_support:
        buf, formula = tokens * h * ws * e, "T*H*ws*e"
    else:
        t1 = min(MNNVL_ONE_SHOT_THRESHOLD // (ws * e * h), tokens)
        oneshot = t1 * h * ws * e
        twoshot = 2 * (-(-tokens // ws)) * ws * h * e
        buf, formula = max(oneshot, twoshot), "max(t1*H*ws*e, 2*ceil(T/ws)*ws*H*e)"
    if t.mnnvl_round32:
        buf, formula = round_up(buf, 32), f"RU({formula}, 32)"
    return buf, formula


def mnnvl_workspace(t: Traits, req: Request, facts: Facts,
                     version: str) -> Union[Plan, PassThrough]:
    ws = req.world_size
    buf, formula = mnnvl_buffer(t, req)
    if buf > MNNVL_MAX_BUFFER:
        return PassThrough("mnnvl buffer larger than UINT32_MAX; FlashInfer raises ValueError")
    allocator = t.mnnvl
    notes: list = []
    device = None
    if t.mnnvl_device_is_local_rank:
        gpn = req.gpus_per_node
        if gpn is None:
            gpn = min(facts.device_count, ws)
        if not is_int(gpn) or gpn <= 0:
            return PassThrough(f"gpus_per_node={gpn!r}; FlashInfer decides")
        if not is_int(req.rank):
            return PassThrough(f"rank={req.rank!r}; FlashInfer decides")
        device = req.rank % gpn
    if allocator == "C":
        # One float32 tensor: numel = bytes // 4, so the request drops to a multiple of 4.
        request = (3 * buf) // 4 * 4
        allocations = c_alloc("mnnvl.buffer", request, f"floor(3*{formula}/4)*4", facts, ws)
        handle = "posix"
        if not facts.multicast_supported:
            notes.append("no multicast: torch leaves the multicast pointer 0 and "
                         "FlashInfer still returns the workspace")
    else:
        if not facts.multicast_supported:
            return PassThrough("mnnvl needs NVLink multicast; FlashInfer raises "
                               "RuntimeError before allocating")
        allocations, handle, notes = b_alloc(allocator, "mnnvl.buffer", 3 * buf,
                                              f"3*{formula}", facts, True)
        allocations.append(Allocation("mnnvl.signal_pads", 8 * ws, "cuMemAlloc",
                                      formula="8*ws"))
        allocations.append(Allocation("mnnvl.uc_ptrs", 8 * ws, "cuMemAlloc",
                                      formula="8*ws"))
    allocations.append(Allocation("mnnvl.buffer_flags", 36, "torch", formula="uint32[9]"))
    return Plan(version, t.label, "unified", "mnnvl", allocator, handle, device,
                tuple(allocations), ws, req.dtype, tuple(notes))

