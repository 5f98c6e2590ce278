"""Per-release allocation rules of FlashInfer's all-reduce fusion workspaces.

Each FlashInfer release belongs to one range (R0–R10, named as in the project's
reference notes). A range fixes: the buffer-size formulas, the allocator of each
entry point (A: cudaMalloc+IPC, B1–B4: SymmDeviceMemory, C: torch symmetric memory,
D: mnnvl-cutedsl symmetric buffers), their rounding, the handle type and the device.
"""

from __future__ import annotations

import re
from typing import Optional, Union

from ._plan import (
    ELEMENT_SIZE,
    Allocation,
    Facts,
    PassThrough,
    Plan,
    Request,
    Unplanned,
    round_up,
)

MiB = 1 << 20
SIGNAL_PAD = 2048  # flashinfer.comm.mnnvl SIGNAL_PAD_SIZE, every release
BARRIER_FLAG_COUNT = 256
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)  # INT32_MAX rounded down to 2 MiB
MNNVL_ONE_SHOT_THRESHOLD = 64 * 1024 * 8 * 2

NEWEST = (0, 7, 4, 0)

# (first release of the range, label), in order; a release belongs to the last range
# whose first release is <= it.
RANGES = (
    ((0, 5, 0, 0), "R0"),
    ((0, 6, 0, 0), "R1"),
    ((0, 6, 7, 0), "R2"),
    ((0, 6, 10, 0), "R3"),
    ((0, 6, 10, 1), "R4"),
    ((0, 6, 15, 0), "R5"),
    ((0, 6, 16, 0), "R6"),
    ((0, 6, 18, 0), "R7"),
    ((0, 7, 2, 0), "R8"),
    ((0, 7, 2, 1), "R9"),
    ((0, 7, 4, 0), "R10"),
)

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?")


def parse_version(text: str) -> tuple:
    """``"0.7.2.post1"`` -> ``(0, 7, 2, 1)``; pre-release and local tags are ignored."""
    match = _VERSION_RE.match(str(text))
    if not match:
        raise Unplanned(f"cannot parse FlashInfer version {text!r}")
    major, minor, micro, post = match.groups()
    return (int(major), int(minor), int(micro or 0), int(post or 0))


def range_of(version: str) -> str:
    key = parse_version(version)
    if key < RANGES[0][0]:
        raise Unplanned(f"FlashInfer {version} is older than 0.5.0; no rules")
    label = RANGES[0][1]
    for first, name in RANGES:
        if key >= first:
            label = name
    return label


def is_unknown(version: str) -> bool:
    """Newer than the newest release whose rules were read."""
    return parse_version(version)[:3] > NEWEST[:3]


def element_size(dtype: Optional[str]) -> int:
    if dtype is None:
        return 4  # torch's default dtype, float32
    try:
        return ELEMENT_SIZE[dtype]
    except KeyError:
        raise Unplanned(f"no element size known for dtype {dtype}") from None


def _rank_index(label: str) -> int:
    return int(label[1:])


# --------------------------------------------------------------------------- helpers


def _b_handle_type(label: str, facts: Facts) -> str:
    if label == "R10":  # B4: FABRIC iff every rank's driver attribute says so (one host)
        return "fabric" if facts.fabric_supported else "posix"
    # B1–B3: local decision, FABRIC needs the NVML fabric state too
    return "fabric" if (facts.fabric_supported and facts.fabric_nvml_ok) else "posix"


def _b_alloc(label: str, name: str, buf: int, facts: Facts, multicast: bool,
             handle: str, formula: str, fabric_fallback: bool) -> list:
    """cuMemCreate(s) of one SymmDeviceMemory of ``buf`` bytes."""
    size = round_up(buf + SIGNAL_PAD, facts.granularity)
    text = f"RU({formula} + 2048, G={facts.granularity})"
    r = _rank_index(label)
    if (r <= 4) or multicast:  # B1 applies Gmc always; B2+ only with multicast
        size = round_up(size, facts.multicast_granularity)
        text = f"RU({text}, Gmc={facts.multicast_granularity})"
    out = []
    if handle == "fabric" and fabric_fallback:
        # B4 on one host: FABRIC first; without an IMEX channel its export fails, it is
        # released, and the same size is created again with POSIX fds.
        out.append(Allocation(name, size, "cuMemCreate", "fabric", held=False,
                              formula=text + " (FABRIC attempt, released)"))
        out.append(Allocation(name, size, "cuMemCreate", "posix", True, text))
    else:
        out.append(Allocation(name, size, "cuMemCreate", handle, True, text))
    return out


def _trtllm_sizes(label: str, req: Request, fp32: bool) -> list:
    ws, t, h = req.world_size, req.max_token_num, req.hidden_dim
    wide = 4 if fp32 else 2
    b_elem = wide if _rank_index(label) >= 8 else 2
    buffer_size = ws * t * h * b_elem
    flag_size = ws * BARRIER_FLAG_COUNT * 4
    lamport_comm = min(ws * t * h * wide, MAX_COMM_SIZE)
    clamp = " clamped to MAX_COMM_SIZE" if ws * t * h * wide > MAX_COMM_SIZE else ""
    return [
        ("trtllm.buffer", buffer_size, f"ws*T*H*{b_elem}"),
        ("trtllm.flag", flag_size, "ws*256*4"),
        ("trtllm.lamport", 3 * lamport_comm, f"3*min(ws*T*H*{wide}, MAX_COMM_SIZE){clamp}"),
    ]


def _check_ints(req: Request, *names: str) -> Optional[PassThrough]:
    for name in names:
        value = getattr(req, name)
        if isinstance(value, bool) or not isinstance(value, int):
            return PassThrough(f"{name}={value!r} is not an int; FlashInfer decides")
        if value <= 0:
            return PassThrough(f"{name}={value!r}; FlashInfer decides")
    return None


def _c_block(size: int, facts: Facts) -> int:
    """torch symmetric memory block for ``size`` bytes (allocator C)."""
    return round_up(round_up(size, 16) + facts.torch_signal_pad, facts.granularity)


def _trtllm_workspace(label: str, req: Request, facts: Facts, version: str,
                      use_symm: bool, entry: str, backend: str) -> Plan:
    fp32 = req.use_fp32_lamport if entry == "legacy" else req.dtype == "float32"
    ws = req.world_size
    allocations: list = []
    r = _rank_index(label)
    notes = []
    if use_symm and r >= 5:
        allocator = {5: "B2", 10: "B4"}.get(r, "B3")
        handle = _b_handle_type(label, facts)
        for name, size, formula in _trtllm_sizes(label, req, fp32):
            allocations += _b_alloc(label, name, round_up(size, 16), facts, False, handle,
                                    f"RU({formula}, 16)", fabric_fallback=(r == 10))
            allocations.append(Allocation(name + ".uc_ptrs", 8 * ws, "cuMemAlloc",
                                          formula="8*ws"))
        device = None
        if handle == "fabric" and r == 10:
            notes.append("FABRIC attempted first; falls back to POSIX fds with the same sizes")
            handle = "posix"
    elif not use_symm and r >= 3:
        allocator = "C"
        handle = "posix"
        for name, size, formula in _trtllm_sizes(label, req, fp32):
            block = _c_block(size, facts)
            allocations.append(Allocation(
                name, block, "cuMemCreate", handle, True,
                f"RU(RU({formula}, 16) + P_t={facts.torch_signal_pad}, G={facts.granularity})"))
            allocations.append(Allocation(name + ".ptr_arrays", 2 * 8 * ws, "torch",
                                          formula="2*raw_alloc(8*ws)"))
        device = None
    else:
        raise Unplanned(f"trtllm workspace rules for {label} are not implemented")
    allocations.append(Allocation("control_flag", 20, "cudaMalloc", formula="5*int32"))
    allocations.append(Allocation("workspace_table", (3 * ws + 1) * 8, "torch",
                                  formula="int64[3*ws+1]"))
    return Plan(version, label, entry, backend, allocator, handle, device,
                tuple(allocations), ws, req.dtype, tuple(notes))


def _mnnvl_workspace(label: str, req: Request, facts: Facts, version: str) -> Union[Plan, PassThrough]:
    r = _rank_index(label)
    if r < 5:
        raise Unplanned(f"mnnvl workspace rules for {label} are not implemented")
    ws, t, h = req.world_size, req.max_token_num, req.hidden_dim
    e = element_size(req.dtype)
    if req.force_oneshot_support:
        buf = t * h * ws * e
        formula = "T*H*ws*e"
    else:
        t1 = min(MNNVL_ONE_SHOT_THRESHOLD // (ws * e * h), t)
        buf = max(t1 * h * ws * e, 2 * (-(-t // ws)) * ws * h * e)
        formula = "max(ONESHOT(t1), TWOSHOT(T))"
    if r >= 7:
        buf = round_up(buf, 32)
        formula = f"RU({formula}, 32)"
    if buf > 2**32 - 1:
        return PassThrough("mnnvl buffer larger than UINT32_MAX; FlashInfer raises ValueError")
    allocator = {5: "B2", 10: "B4"}.get(r, "B3")
    handle = _b_handle_type(label, facts)
    allocations = _b_alloc(label, "mnnvl.buffer", 3 * buf, facts, True, handle,
                           f"3*{formula}", fabric_fallback=(r == 10))
    allocations.append(Allocation("mnnvl.signal_pads", 8 * ws, "cuMemAlloc", formula="8*ws"))
    allocations.append(Allocation("mnnvl.uc_ptrs", 8 * ws, "cuMemAlloc", formula="8*ws"))
    allocations.append(Allocation("mnnvl.buffer_flags", 36, "torch", formula="uint32[9]"))
    if handle == "fabric" and r == 10:
        handle = "posix"
    return Plan(version, label, "unified", "mnnvl", allocator, handle, None,
                tuple(allocations), ws, req.dtype)


# --------------------------------------------------------------------------- entry


def plan(req: Request, facts: Facts, version: str) -> Union[Plan, PassThrough]:
    label = range_of(version)
    r = _rank_index(label)
    bad = _check_ints(req, "world_size", "max_token_num", "hidden_dim")
    if bad is not None:
        return bad
    if req.entry == "legacy":
        if req.use_symm_dev_mem and not req.create_metadata:
            return PassThrough("use_symm_dev_mem needs create_metadata=True (FlashInfer ValueError)")
        use_symm = req.use_symm_dev_mem and r >= 5  # R3–R4 ignore the flag (C either way)
        return _trtllm_workspace(label, req, facts, version, use_symm, "legacy", "trtllm")

    backend = req.backend
    if backend not in ("trtllm", "mnnvl", "auto", "mnnvl-cutedsl"):
        return PassThrough(f"unknown backend {backend!r}; FlashInfer raises its own error")
    if backend == "mnnvl-cutedsl" and r < 9:
        return PassThrough("backend 'mnnvl-cutedsl' is not accepted by this release")
    if r >= 9 and req.cutedsl_options and backend != "mnnvl-cutedsl":
        return PassThrough("mnnvl-cutedsl options given to another backend (FlashInfer ValueError)")
    if backend == "mnnvl-cutedsl":
        raise Unplanned("mnnvl-cutedsl rules are not implemented")
    if backend == "auto":
        if r <= 5:
            backend = "mnnvl"
        else:
            mc = facts.multicast_all_ranks
            if mc is None:
                mc = facts.multicast_supported
            if mc:
                backend = "mnnvl"
            elif req.world_size <= 16:
                backend = "trtllm"
            else:
                return PassThrough("no suitable backend (FlashInfer ValueError)")
    if backend == "trtllm":
        use_symm = not (facts.confidential_compute and r >= 6)
        return _trtllm_workspace(label, req, facts, version, use_symm, "unified", "trtllm")
    if r >= 6 and facts.confidential_compute:
        return PassThrough("mnnvl under confidential compute (FlashInfer ValueError)")
    return _mnnvl_workspace(label, req, facts, version)


def needs_group_multicast_vote(req: Request, version: str) -> bool:
    """Whether ``auto`` is resolved by a group-wide multicast vote in this release."""
    return req.entry == "unified" and req.backend == "auto" and _rank_index(range_of(version)) >= 6
