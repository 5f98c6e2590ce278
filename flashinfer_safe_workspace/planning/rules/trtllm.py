"""The trtllm workspace (unified ``backend="trtllm"`` and the legacy IPC function)."""

from __future__ import annotations

from typing import Optional, Union

from ..plan import Allocation, Facts, PassThrough, Plan, Request, dtype_name, round_up
from .allocators import A_ROUNDING, b_alloc, c_alloc
from .common import is_int
from .versions import Traits

BARRIER_FLAG_COUNT = 256
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)  # INT32_MAX rounded down to 2 MiB
LAMPORT_BUFFERS = 3


def _trtllm_sizes(t: Traits, req: Request, fp32: bool) -> list:
    ws, tokens, h = req.world_size, req.max_token_num, req.hidden_dim
    wide = 4 if fp32 else 2
    b_elem = wide if t.wide_fp32_buffer else 2
    lamport = ws * tokens * h * wide
    clamp = " clamped to MAX_COMM_SIZE" if lamport > MAX_COMM_SIZE else ""
    return [
        ("trtllm.buffer", ws * tokens * h * b_elem, f"ws*T*H*{b_elem}"),
        ("trtllm.flag", ws * BARRIER_FLAG_COUNT * 4, "ws*256*4"),
        ("trtllm.lamport", 3 * min(lamport, MAX_COMM_SIZE),
         f"3*min(ws*T*H*{wide}, MAX_COMM_SIZE){clamp}"),
    ]


def trtllm_workspace(t: Traits, req: Request, facts: Facts, version: str,
                      allocator: str, entry: str) -> Union[Plan, PassThrough]:
    fp32 = req.use_fp32_lamport if entry == "legacy" else dtype_name(req.dtype) == "float32"
    ws = req.world_size
    device = None
    if allocator == "B1" and t.trtllm_device_is_rank:
        device = req.rank
        if not is_int(device) or device < 0:
            return PassThrough(f"tp_rank={device!r} is the CUDA ordinal here; FlashInfer decides")
    if allocator == "B1" and not facts.multicast_supported:
        # B1 checks MULTICAST_SUPPORTED even without multicast, before any collective
        return PassThrough("SymmDeviceMemory (0.6.0–0.6.14) needs a multicast-capable "
                           "device; FlashInfer raises RuntimeError")
    allocations: list = []
    notes: list = []
    handle: Optional[str] = None
    for name, size, formula in _trtllm_sizes(t, req, fp32):
        if allocator in ("A", "B1"):
            pre, pre_text = round_up(size, A_ROUNDING), f"RU({formula}, 2MiB)"
        else:
            pre, pre_text = round_up(size, 16), f"RU({formula}, 16)"
        if allocator == "A":
            allocations.append(Allocation(name, pre, "cudaMalloc", None, True, pre_text))
            handle = None
        elif allocator == "C":
            allocations += c_alloc(name, pre, pre_text, facts, ws)
            handle = "posix"
        else:
            allocs, handle, more = b_alloc(allocator, name, pre, pre_text, facts, False)
            allocations += allocs
            notes += [n for n in more if n not in notes]
            allocations.append(Allocation(name + ".uc_ptrs", 8 * ws, "cuMemAlloc",
                                          formula="8*ws"))
    allocations.append(Allocation("control_flag", 20, "cudaMalloc", formula="5*int32"))
    allocations.append(Allocation("workspace_table", (3 * ws + 1) * 8, "torch",
                                  formula="int64[3*ws+1]"))
    if device is not None and device >= facts.device_count:
        notes.append(f"allocates on cuda:{device} (tp_rank) but this process sees "
                     f"{facts.device_count} device(s): cuDeviceGet fails on this rank")
    return Plan(version, t.label, entry, "trtllm", allocator, handle, device,
                tuple(allocations), ws, req.dtype, tuple(notes))

