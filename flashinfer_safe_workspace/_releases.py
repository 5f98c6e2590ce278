"""Per-release allocation rules of FlashInfer's all-reduce fusion workspaces.

Each FlashInfer release belongs to one range (R0–R10, named as in the project's
reference notes, /work/shared/reference/flashinfer-allocations.md). A range fixes:
the buffer-size formulas, the allocator of each entry point (A: cudaMalloc+IPC,
B1–B4: SymmDeviceMemory, C: torch symmetric memory, D: mnnvl-cutedsl symmetric
buffers), their rounding, the handle type and the device.

Pure Python on purpose (no torch, no CUDA): plans are cheap to compute and to fuzz.
The formulas here are written from the reference's formulas, not copied code; the
conformance test (tests/test_conformance.py) runs FlashInfer's real creation code
against recording stand-ins and compares what it asks for with these plans.
"""

from __future__ import annotations

import dataclasses
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
MNNVL_MAX_BUFFER = 2**32 - 1  # UINT32_MAX: larger mnnvl buffers are a ValueError
LAMPORT_BUFFERS = 3
A_ROUNDING = 2 * MiB  # trtllm buffers before SymmDeviceMemory/cudaMalloc, 0.5.0–0.6.9
CUTEDSL_TP_SIZES = (2, 4, 8, 16)

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

# Element sizes beyond _plan.ELEMENT_SIZE (torch dtype names without "torch.").
_MORE_ELEMENT_SIZES = {
    "float64": 8, "int64": 8, "uint64": 8, "complex64": 8,
    "int32": 4, "uint32": 4,
    "int16": 2, "uint16": 2,
    "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?")


def parse_version(text: str) -> tuple:
    """``"0.7.2.post1"`` -> ``(0, 7, 2, 1)``; pre-release and local tags are ignored."""
    match = _VERSION_RE.match(str(text))
    if not match:
        raise Unplanned(f"cannot parse FlashInfer version {text!r}")
    major, minor, micro, post = match.groups()
    return (int(major), int(minor), int(micro or 0), int(post or 0))


def range_of(version: str) -> str:
    """The range label (``"R0"`` … ``"R10"``) whose rules apply to ``version``.

    Releases newer than the newest one read use the newest rules (see is_unknown)."""
    key = parse_version(version)
    if key < RANGES[0][0]:
        raise Unplanned(f"FlashInfer {version} is older than 0.5.0; no rules")
    label = RANGES[0][1]
    for first, name in RANGES:
        if key >= first:
            label = name
    return label


def is_unknown(version: str) -> bool:
    """Newer than the newest release whose rules were read (its plan uses R10's rules)."""
    return parse_version(version)[:3] > NEWEST[:3]


def _dtype_name(dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def element_size(dtype: Optional[str]) -> int:
    if dtype is None:
        return 4  # torch's default dtype, float32
    name = _dtype_name(dtype)
    size = ELEMENT_SIZE.get(name) or _MORE_ELEMENT_SIZES.get(name)
    if size is None:
        raise Unplanned(f"no element size known for dtype {dtype}")
    return size


def _rank_index(label: str) -> int:
    return int(label[1:])


# --------------------------------------------------------------------------- per range


@dataclasses.dataclass(frozen=True)
class Traits:
    """What differs between ranges, as data."""

    label: str
    unified: bool  # create_allreduce_fusion_workspace exists (0.6.0+)
    auto_vote: bool  # auto = group multicast vote (0.6.16+); before: always mnnvl
    confidential_compute: bool  # is_confidential_compute() is consulted (0.6.16+)
    trtllm: str  # allocator of the unified trtllm workspace (non-CC)
    legacy_default: str  # allocator of the legacy function with use_symm_dev_mem=False
    legacy_symm: Optional[str]  # ... with use_symm_dev_mem=True (None: no such parameter)
    mnnvl: str  # allocator of the mnnvl workspace
    trtllm_device_is_rank: bool  # 0.6.0–0.6.6: trtllm SymmDeviceMemory on cuda:tp_rank
    mnnvl_device_is_local_rank: bool  # 0.6.0–0.6.6: mnnvl on rank % gpus_per_node
    wide_fp32_buffer: bool  # 0.7.2+: trtllm buffer B uses 4-byte elements for fp32
    mnnvl_round32: bool  # 0.6.18+: mnnvl per-buffer size rounded up to 32 bytes
    cutedsl_factory: bool  # "mnnvl-cutedsl" accepted by the factory (0.7.2.post1+)


def _traits(label: str) -> Traits:
    r = _rank_index(label)
    b = {5: "B2", 10: "B4"}.get(r, "B3" if r >= 6 else "B1")
    symm_alloc = "C" if r in (3, 4) else b
    return Traits(
        label=label,
        unified=r >= 1,
        auto_vote=r >= 6,
        confidential_compute=r >= 6,
        trtllm=symm_alloc,
        legacy_default="A" if r <= 2 else "C",
        legacy_symm=None if r == 0 else symm_alloc,
        mnnvl=symm_alloc,
        trtllm_device_is_rank=r == 1,
        mnnvl_device_is_local_rank=r == 1,
        wide_fp32_buffer=r >= 8,
        mnnvl_round32=r >= 7,
        cutedsl_factory=r >= 9,
    )


def traits(version: str) -> Traits:
    """The per-range traits of ``version`` (for callers and tests)."""
    return _traits(range_of(version))


# --------------------------------------------------------------------------- allocators


def _b_handle_type(allocator: str, facts: Facts) -> str:
    """Handle type SymmDeviceMemory asks for first."""
    if allocator == "B4":
        # 0.7.4 votes: on one host FABRIC iff every rank's driver attribute says so.
        return "fabric" if facts.fabric_supported else "posix"
    # B1–B3 decide locally and also need the NVML fabric state (is_mnnvl_fabric_supported)
    return "fabric" if (facts.fabric_supported and facts.fabric_nvml_ok) else "posix"


def _b_alloc(allocator: str, name: str, buf: int, buf_formula: str, facts: Facts,
             multicast: bool) -> tuple:
    """The cuMemCreate(s) of one SymmDeviceMemory of ``buf`` bytes.

    Returns (allocations, handle type held, notes)."""
    g = facts.granularity
    size = round_up(buf + SIGNAL_PAD, g)
    text = f"RU({buf_formula} + 2048, G={g})"
    if allocator == "B1" or multicast:  # B1 applies Gmc always; B2+ only with multicast
        gmc = facts.gmc(size)  # asked for this object's size, as FlashInfer asks
        size = round_up(size, gmc)
        text = f"RU({text}, Gmc={gmc})"
    handle = _b_handle_type(allocator, facts)
    notes = []
    out = []
    if handle == "fabric" and not facts.imex_channel:
        if allocator == "B4":
            # One host: the FABRIC allocation is created, its export fails without an
            # IMEX channel, every rank releases it, and the same size is created again
            # with POSIX file descriptors.
            out.append(Allocation(name, size, "cuMemCreate", "fabric", held=False,
                                  formula=text + " (FABRIC attempt, released)"))
            handle = "posix"
            notes.append("FABRIC attempted first; no IMEX channel, so each buffer is "
                         "created again with POSIX fds (same size)")
        else:
            notes.append("FABRIC handles without an IMEX channel: FlashInfer's export "
                         "fails after the first cuMemCreate (RuntimeError on every rank)")
    out.append(Allocation(name, size, "cuMemCreate", handle, True, text))
    return out, handle, notes


def _c_alloc(name: str, request: int, req_formula: str, facts: Facts, ws: int) -> list:
    """torch symmetric memory: one cuMemCreate block, then the rendezvous' two
    pointer arrays from the caching allocator."""
    block = round_up(round_up(request, 16) + facts.torch_signal_pad, facts.granularity)
    return [
        Allocation(name, block, "cuMemCreate", "posix", True,
                   f"RU(RU({req_formula}, 16) + P_t={facts.torch_signal_pad}, "
                   f"G={facts.granularity})"),
        Allocation(name + ".buffer_ptrs", 8 * ws, "torch", formula="raw_alloc(8*ws)"),
        Allocation(name + ".signal_pad_ptrs", 8 * ws, "torch", formula="raw_alloc(8*ws)"),
    ]


# --------------------------------------------------------------------------- trtllm


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


def _trtllm_workspace(t: Traits, req: Request, facts: Facts, version: str,
                      allocator: str, entry: str) -> Union[Plan, PassThrough]:
    fp32 = req.use_fp32_lamport if entry == "legacy" else _dtype_name(req.dtype) == "float32"
    ws = req.world_size
    device = None
    if allocator == "B1" and t.trtllm_device_is_rank:
        device = req.rank
        if not _is_int(device) or device < 0:
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
            allocations += _c_alloc(name, pre, pre_text, facts, ws)
            handle = "posix"
        else:
            allocs, handle, more = _b_alloc(allocator, name, pre, pre_text, facts, False)
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


# --------------------------------------------------------------------------- mnnvl


def _mnnvl_buffer(t: Traits, req: Request) -> tuple:
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


def _mnnvl_workspace(t: Traits, req: Request, facts: Facts,
                     version: str) -> Union[Plan, PassThrough]:
    ws = req.world_size
    buf, formula = _mnnvl_buffer(t, req)
    if buf > MNNVL_MAX_BUFFER:
        return PassThrough("mnnvl buffer larger than UINT32_MAX; FlashInfer raises ValueError")
    allocator = t.mnnvl
    notes: list = []
    device = None
    if t.mnnvl_device_is_local_rank:
        gpn = req.gpus_per_node
        if gpn is None:
            gpn = min(facts.device_count, ws)
        if not _is_int(gpn) or gpn <= 0:
            return PassThrough(f"gpus_per_node={gpn!r}; FlashInfer decides")
        if not _is_int(req.rank):
            return PassThrough(f"rank={req.rank!r}; FlashInfer decides")
        device = req.rank % gpn
    if allocator == "C":
        # One float32 tensor: numel = bytes // 4, so the request drops to a multiple of 4.
        request = (3 * buf) // 4 * 4
        allocations = _c_alloc("mnnvl.buffer", request, f"floor(3*{formula}/4)*4", facts, ws)
        handle = "posix"
        if not facts.multicast_supported:
            notes.append("no multicast: torch leaves the multicast pointer 0 and "
                         "FlashInfer still returns the workspace")
    else:
        if not facts.multicast_supported:
            return PassThrough("mnnvl needs NVLink multicast; FlashInfer raises "
                               "RuntimeError before allocating")
        allocations, handle, notes = _b_alloc(allocator, "mnnvl.buffer", 3 * buf,
                                              f"3*{formula}", facts, True)
        allocations.append(Allocation("mnnvl.signal_pads", 8 * ws, "cuMemAlloc",
                                      formula="8*ws"))
        allocations.append(Allocation("mnnvl.uc_ptrs", 8 * ws, "cuMemAlloc",
                                      formula="8*ws"))
    allocations.append(Allocation("mnnvl.buffer_flags", 36, "torch", formula="uint32[9]"))
    return Plan(version, t.label, "unified", "mnnvl", allocator, handle, device,
                tuple(allocations), ws, req.dtype, tuple(notes))


# --------------------------------------------------------------------------- mnnvl-cutedsl


# Element counts of the small caching-allocator tensors allocator D's protocols make.
CUTEDSL_LAMPORT_GENERATIONS = 3  # every mnnvl-cutedsl mailbox has 3 Lamport generations
CUTEDSL_LL_STAGE_WORDS = 2  # LL stage state, int32
CUTEDSL_BT_STAGE_WORDS = 6  # BT stage state, int32 (ticket counters + generations)
CUTEDSL_PLANNED_RANGES = ("R10",)  # ranges whose D sequence the conformance test checked


def _cutedsl_option(req: Request, name: str, default):
    """The value of a keyword-only mnnvl-cutedsl option: the real value where the
    request carries it (cutedsl_values), else read back from its repr."""
    values = dict(req.cutedsl_values)
    if name in values:
        return values[name]
    text = dict(req.cutedsl_options).get(name)
    if text is None:
        return default
    if isinstance(default, bool):
        return text == "True"
    if name == "top_k":
        try:
            return int(text)
        except ValueError:
            raise Unplanned(f"mnnvl-cutedsl top_k={text}: not an int") from None
    if name == "output_dtype":
        return text
    raise Unplanned(f"mnnvl-cutedsl option {name}={text} cannot be planned from its repr")


def _cutedsl(t: Traits, req: Request, facts: Facts,
             version: str) -> Union[Plan, PassThrough]:
    """mnnvl-cutedsl: FlashInfer's own argument checks, all before any allocation, then
    allocator D's plan (see _cutedsl_plan)."""
    ignored = [name for name, given in (("gpus_per_node", req.gpus_per_node is not None),
                                        ("comm_backend", req.has_comm_backend),
                                        ("force_oneshot_support", req.force_oneshot_support))
               if given]
    if ignored:
        return PassThrough("backend='mnnvl-cutedsl' does not use: " + ", ".join(ignored)
                           + " (FlashInfer ValueError)")
    options = dict(req.cutedsl_options)

    def flag(name: str, default: bool) -> bool:
        text = options.get(name)
        return default if text is None else text == "True"

    output = options.get("output_dtype", "torch.bfloat16")
    apply_norm = flag("apply_rms_norm", True)
    if req.world_size not in CUTEDSL_TP_SIZES:
        return PassThrough("mnnvl-cutedsl needs tp_size 2, 4, 8 or 16 (FlashInfer ValueError)")
    if not apply_norm and not flag("write_residual_output", True):
        return PassThrough("mnnvl-cutedsl without the norm needs write_residual_output "
                           "(FlashInfer ValueError)")
    if _dtype_name(req.dtype) != "bfloat16":
        return PassThrough("mnnvl-cutedsl supports bfloat16 only (FlashInfer ValueError)")
    if output not in ("torch.bfloat16", "torch.float8_e4m3fn"):
        return PassThrough("mnnvl-cutedsl output_dtype must be bfloat16 or float8_e4m3fn "
                           "(FlashInfer ValueError)")
    fp8 = output == "torch.float8_e4m3fn"
    if (not apply_norm and fp8) or (flag("write_norm_output", False) and not fp8) \
            or (flag("dynamic_fp8", False) and not fp8):
        return PassThrough("inconsistent mnnvl-cutedsl output options (FlashInfer ValueError)")
    rank = req.rank
    if not _is_int(rank) or not 0 <= rank < req.world_size:
        return PassThrough("mnnvl-cutedsl tp_rank out of range (FlashInfer ValueError)")
    if tuple(facts.compute_capability)[:1] < (10,):
        return PassThrough("mnnvl-cutedsl needs a Blackwell GPU (FlashInfer RuntimeError)")
    if not facts.multicast_supported:
        return PassThrough("mnnvl-cutedsl needs NVLink multicast (FlashInfer RuntimeError)")
    return _cutedsl_plan(t, req, facts, version, apply_norm)


def _flashinfer_cutedsl_tables(version: str):
    """FlashInfer's own mnnvl-cutedsl config module, from the FlashInfer planned for.

    The per-protocol capacities are data in FlashInfer's profile tables; this module
    asks them (config lookup, ``protocol_capacity``, the route ranges) and computes the
    buffers with our formulas. Unplanned where they cannot be asked."""
    try:
        import importlib

        flashinfer = importlib.import_module("flashinfer")
        torch = importlib.import_module("torch")
        tables = importlib.import_module("flashinfer.comm.mnnvl_cutedsl")
    except Exception as exc:  # noqa: BLE001 - any failure to import: no tables
        raise Unplanned(f"mnnvl-cutedsl (allocator D) needs FlashInfer's profile tables, "
                        f"which cannot be imported here: {exc!r}") from None
    installed = getattr(flashinfer, "__version__", None)
    if installed is None or parse_version(installed) != parse_version(version):
        raise Unplanned(f"mnnvl-cutedsl (allocator D) is planned from the importable "
                        f"FlashInfer's profile tables, which are {installed}, not {version}")
    for name in ("DEFAULT_CONFIG", "NO_NORM_CONFIG", "ProtocolKind"):
        if not hasattr(tables, name):
            raise Unplanned(f"FlashInfer {installed} has no mnnvl_cutedsl.{name}")
    return tables, torch


def _route_ranges(routes, capacity: int) -> list:
    """(first, last, target) of each route range that starts at or below ``capacity``,
    ``last`` clipped to it."""
    out = []
    first = 1
    for upper, target in zip(routes.upper_bounds, routes.targets):
        if first > capacity:
            break
        last = capacity if upper is None else min(upper, capacity)
        out.append((first, last, target))
        if upper is None:
            break
        first = last + 1
    return out


def _presets(routes, protocol, capacity: int) -> list:
    """The distinct presets ``routes`` sends to ``protocol`` up to ``capacity``, in order."""
    seen: list = []
    for _, _, target in _route_ranges(routes, capacity):
        if target.protocol is protocol and target.preset not in seen:
            seen.append(target.preset)
    return seen


def _cutedsl_plan(t: Traits, req: Request, facts: Facts, version: str,
                  apply_norm: bool) -> Union[Plan, PassThrough]:
    """Allocator D: the workspace's symmetric buffers (each one torch symmetric-memory
    block, allocator C's rule, plus the rendezvous' pointer arrays) and its small
    caching-allocator tensors, protocol by protocol (reference §3-D, §4.3)."""
    if t.label not in CUTEDSL_PLANNED_RANGES or is_unknown(version):
        raise Unplanned(f"mnnvl-cutedsl (allocator D) is planned for FlashInfer 0.7.4 only; "
                        f"{version} is not checked against it")
    tables, torch = _flashinfer_cutedsl_tables(version)
    ws, tokens, h = req.world_size, req.max_token_num, req.hidden_dim
    top_k = _cutedsl_option(req, "top_k", 10)
    dynamic_fp8 = _cutedsl_option(req, "dynamic_fp8", False)
    config = _cutedsl_option(req, "config", None)
    if config is None:
        config = tables.DEFAULT_CONFIG if apply_norm else tables.NO_NORM_CONFIG
    kind = tables.ProtocolKind
    measured_with = getattr(config, "applies_rms_norm", None)
    if measured_with is not None and measured_with != apply_norm:
        return PassThrough("mnnvl-cutedsl config measured with another apply_rms_norm "
                           "(FlashInfer ValueError)")
    cc = tuple(int(x) for x in tuple(facts.compute_capability)[:2])
    try:
        profile = config.resolve(tp_size=ws, hidden_size=h, top_k=top_k,
                                 dtype=torch.bfloat16, capacity_m=tokens,
                                 compute_capability=cc)
    except ValueError as exc:
        return PassThrough(f"mnnvl-cutedsl: {exc} (FlashInfer ValueError)")
    capacity = {p: profile.protocol_capacity(p, capacity_m=tokens)
                for p in (kind.LL, kind.BT, kind.HT)}
    if not apply_norm and capacity[kind.HT] is not None:
        return PassThrough("mnnvl-cutedsl: the HT protocol needs the norm "
                           "(FlashInfer NotImplementedError)")
    if dynamic_fp8 and any(
            target.protocol is kind.LL and getattr(target.preset, "two_shot", False)
            for _, _, target in _route_ranges(profile.all_reduce_routes, tokens)):
        return PassThrough("mnnvl-cutedsl: the LL two-shot all-reduce has no dynamic FP8 "
                           "(FlashInfer ValueError)")

    allocations: list = []
    bf16 = ELEMENT_SIZE["bfloat16"]
    gens = CUTEDSL_LAMPORT_GENERATIONS

    def symmetric(name: str, shape: tuple, shape_text: str, elem: int,
                  peers: bool) -> None:
        count = 1
        for dim in shape:
            count *= dim
        allocations.extend(_c_alloc(name, count * elem, f"{shape_text}*{elem}", facts, ws))
        if peers:  # materialize_peer_addresses: int64[ws] of peer addresses
            allocations.append(Allocation(name + ".peer_addresses", 8 * ws, "torch",
                                          formula="int64[ws]"))

    def small(name: str, count: int, elem: int, text: str) -> None:
        allocations.append(Allocation(name, count * elem, "torch", formula=text))

    if not apply_norm:
        small("cutedsl.gamma_placeholder", h, bf16, "bf16[H]")
    c_ll = capacity[kind.LL]
    if c_ll is not None:
        routes = profile.all_reduce_routes
        presets = _presets(routes, kind.LL, c_ll)
        one_shot = [p for p in presets if not getattr(p, "two_shot", False)]
        symmetric("cutedsl.ll.mailbox", (gens, ws, c_ll, h), f"3*ws*{c_ll}*H", bf16,
                  any(getattr(p, "peer_stores", False) for p in one_shot))
        small("cutedsl.ll.stage_state", CUTEDSL_LL_STAGE_WORDS, 4, "int32[2]")
        # Two-shot mailboxes: one pair per collective shape, sized to the largest token
        # count routed to any two-shot preset of that shape.
        served: dict = {}
        for first, last, target in _route_ranges(routes, c_ll):
            if target.protocol is kind.LL:
                served[target.preset] = max(served.get(target.preset, 0), last)
        shapes: dict = {}
        for preset in presets:
            if getattr(preset, "two_shot", False):
                c2 = min(served.get(preset, c_ll), c_ll)
                shapes[preset.collective] = max(shapes.get(preset.collective, 0), c2)
        for collective, c2 in shapes.items():
            symmetric("cutedsl.ll.two_shot.scatter", (gens, ws, c2, h), f"3*ws*{c2}*H",
                      bf16, True)
            symmetric("cutedsl.ll.two_shot.gather", (gens, c2, h), f"3*{c2}*H", bf16, False)
            cluster = collective.cluster_size
            small("cutedsl.ll.two_shot.generations", c2 * cluster, 4,
                  f"int32[{c2}*{cluster}]")
    c_bt = capacity[kind.BT]
    if c_bt is not None:
        local = -(-c_bt // ws)
        symmetric("cutedsl.bt.contribution", (gens, ws, local, h),
                  f"3*ws*ceil({c_bt}/ws)*H", bf16, True)
        symmetric("cutedsl.bt.prenorm", (gens, c_bt, h), f"3*{c_bt}*H", bf16, True)
        small("cutedsl.bt.stage_state", CUTEDSL_BT_STAGE_WORDS, 4, "int32[6]")
    c_ht = capacity[kind.HT]
    if c_ht is not None:
        slots = -(-c_ht // ws)
        for which in ("routed", "all_reduce"):
            symmetric(f"cutedsl.ht.{which}_ready", (slots,), f"ceil({c_ht}/ws)", 4, True)
            small(f"cutedsl.ht.{which}_processed", slots * ws, 4,
                  f"uint32[ceil({c_ht}/ws), ws]")
        symmetric("cutedsl.ht.local", (c_ht, h), f"{c_ht}*H", bf16, False)
        symmetric("cutedsl.ht.prenorm", (c_ht, h), f"{c_ht}*H", bf16, False)
    notes = [f"capacities LL={c_ll} BT={c_bt} HT={c_ht} (FlashInfer {version} profile "
             f"tp={ws} H={h} top_k={top_k} cc={cc})"]
    if facts.multicast_all_ranks is False:
        notes.append("a peer lacks multicast: torch leaves the multicast pointer 0 and "
                     "FlashInfer raises RuntimeError after the first multicast buffer")
    return Plan(version, t.label, "unified", "mnnvl-cutedsl", "D", "posix", None,
                tuple(allocations), ws, req.dtype, tuple(notes))


# --------------------------------------------------------------------------- entry


def _check_ints(req: Request, *names: str) -> Optional[PassThrough]:
    for name in names:
        value = getattr(req, name)
        if not _is_int(value):
            return PassThrough(f"{name}={value!r} is not an int; FlashInfer decides")
        if value <= 0:
            return PassThrough(f"{name}={value!r}; FlashInfer decides")
    return None


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


def plan(req: Request, facts: Facts, version: str) -> Union[Plan, PassThrough]:
    """The plan of ``req`` under FlashInfer ``version`` (see _plan.make_plan)."""
    t = _traits(range_of(version))
    if req.entry == "legacy":
        if t.legacy_symm is None and (req.use_symm_dev_mem or req.has_comm_backend):
            return PassThrough("0.5.x has no use_symm_dev_mem/comm_backend parameter "
                               "(FlashInfer TypeError)")
        if req.use_symm_dev_mem and not req.create_metadata:
            return PassThrough("use_symm_dev_mem needs create_metadata=True (FlashInfer ValueError)")
        bad = _check_ints(req, "world_size", "max_token_num", "hidden_dim")
        if bad is not None:
            return bad
        allocator = t.legacy_symm if req.use_symm_dev_mem else t.legacy_default
        return _trtllm_workspace(t, req, facts, version, allocator, "legacy")
    if req.entry != "unified":
        raise Unplanned(f"unknown entry {req.entry!r}")
    if not t.unified:
        return PassThrough("this release has no create_allreduce_fusion_workspace")

    backend = req.backend
    if req.cutedsl_options and not t.cutedsl_factory:
        return PassThrough("keyword-only mnnvl-cutedsl options do not exist in this "
                           "release (FlashInfer TypeError)")
    if backend == "mnnvl-cutedsl" and t.cutedsl_factory:
        bad = _check_ints(req, "world_size", "max_token_num", "hidden_dim")
        if bad is not None:
            return bad
        return _cutedsl(t, req, facts, version)
    if t.cutedsl_factory and req.cutedsl_options:
        return PassThrough("mnnvl-cutedsl options given to another backend (FlashInfer ValueError)")
    if backend not in ("trtllm", "mnnvl", "auto"):
        return PassThrough(f"unknown backend {backend!r}; FlashInfer raises RuntimeError")
    bad = _check_ints(req, "world_size", "max_token_num", "hidden_dim")
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
        return _trtllm_workspace(t, req, facts, version, allocator, "unified")
    if cc:
        return PassThrough("mnnvl under confidential compute (FlashInfer ValueError)")
    return _mnnvl_workspace(t, req, facts, version)


def needs_group_multicast_vote(req: Request, version: str) -> bool:
    """Whether ``auto`` is resolved by a group-wide multicast vote in this release."""
    return req.entry == "unified" and req.backend == "auto" and _traits(range_of(version)).auto_vote
