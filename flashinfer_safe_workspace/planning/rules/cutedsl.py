"""mnnvl-cutedsl (allocator D, FlashInfer 0.7.2.post1+): FlashInfer's own argument
checks, then the workspace's symmetric buffers and small tensors.

The only rules module that imports torch and FlashInfer: the per-protocol capacities
are data in FlashInfer's profile tables, asked of the FlashInfer planned for (lazily,
inside :func:`cutedsl_workspace`; never at import time).
"""

from __future__ import annotations

from typing import Union

from ..plan import (
    ELEMENT_SIZE,
    Allocation,
    Facts,
    PassThrough,
    Plan,
    Request,
    Unplanned,
    dtype_name,
)
from .allocators import c_alloc
from .common import is_int
from .versions import Traits, is_unknown, parse_version

CUTEDSL_TP_SIZES = (2, 4, 8, 16)
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


def cutedsl_workspace(t: Traits, req: Request, facts: Facts,
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
    if dtype_name(req.dtype) != "bfloat16":
        return PassThrough("mnnvl-cutedsl supports bfloat16 only (FlashInfer ValueError)")
    if output not in ("torch.bfloat16", "torch.float8_e4m3fn"):
        return PassThrough("mnnvl-cutedsl output_dtype must be bfloat16 or float8_e4m3fn "
                           "(FlashInfer ValueError)")
    fp8 = output == "torch.float8_e4m3fn"
    if (not apply_norm and fp8) or (flag("write_norm_output", False) and not fp8) \
            or (flag("dynamic_fp8", False) and not fp8):
        return PassThrough("inconsistent mnnvl-cutedsl output options (FlashInfer ValueError)")
    rank = req.rank
    if not is_int(rank) or not 0 <= rank < req.world_size:
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


class _Buffers:
    """The allocations of one mnnvl-cutedsl plan, in FlashInfer's order."""

    def __init__(self, facts: Facts, ws: int):
        self.facts, self.ws = facts, ws
        self.allocations: list = []

    def symmetric(self, name: str, shape: tuple, shape_text: str, elem: int,
                  peers: bool) -> None:
        """One torch symmetric-memory block (allocator C's rule), with the int64[ws] of
        peer addresses that ``materialize_peer_addresses`` makes when ``peers``."""
        count = 1
        for dim in shape:
            count *= dim
        self.allocations.extend(c_alloc(name, count * elem, f"{shape_text}*{elem}", self.facts,
                                        self.ws))
        if peers:
            self.allocations.append(Allocation(name + ".peer_addresses", 8 * self.ws, "torch",
                                               formula="int64[ws]"))

    def small(self, name: str, count: int, elem: int, text: str) -> None:
        """A small caching-allocator tensor."""
        self.allocations.append(Allocation(name, count * elem, "torch", formula=text))


def _cutedsl_profile(t: Traits, req: Request, facts: Facts, version: str, apply_norm: bool):
    """``(tables, profile, capacity by protocol, top_k, cc)`` from FlashInfer's own profile
    tables, or the PassThrough for a call FlashInfer rejects there."""
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
    return tables, profile, capacity, top_k, cc


def _ll_buffers(b: _Buffers, profile, kind, c_ll: int, h: int) -> None:
    """The LL protocol: its one-shot mailbox, stage state and two-shot mailboxes."""
    bf16, gens, ws = ELEMENT_SIZE["bfloat16"], CUTEDSL_LAMPORT_GENERATIONS, b.ws
    routes = profile.all_reduce_routes
    presets = _presets(routes, kind.LL, c_ll)
    one_shot = [p for p in presets if not getattr(p, "two_shot", False)]
    b.symmetric("cutedsl.ll.mailbox", (gens, ws, c_ll, h), f"3*ws*{c_ll}*H", bf16,
                any(getattr(p, "peer_stores", False) for p in one_shot))
    b.small("cutedsl.ll.stage_state", CUTEDSL_LL_STAGE_WORDS, 4, "int32[2]")
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
        b.symmetric("cutedsl.ll.two_shot.scatter", (gens, ws, c2, h), f"3*ws*{c2}*H", bf16, True)
        b.symmetric("cutedsl.ll.two_shot.gather", (gens, c2, h), f"3*{c2}*H", bf16, False)
        cluster = collective.cluster_size
        b.small("cutedsl.ll.two_shot.generations", c2 * cluster, 4, f"int32[{c2}*{cluster}]")


def _bt_buffers(b: _Buffers, c_bt: int, h: int) -> None:
    bf16, gens, ws = ELEMENT_SIZE["bfloat16"], CUTEDSL_LAMPORT_GENERATIONS, b.ws
    local = -(-c_bt // ws)
    b.symmetric("cutedsl.bt.contribution", (gens, ws, local, h), f"3*ws*ceil({c_bt}/ws)*H",
                bf16, True)
    b.symmetric("cutedsl.bt.prenorm", (gens, c_bt, h), f"3*{c_bt}*H", bf16, True)
    b.small("cutedsl.bt.stage_state", CUTEDSL_BT_STAGE_WORDS, 4, "int32[6]")


def _ht_buffers(b: _Buffers, c_ht: int, h: int) -> None:
    bf16, ws = ELEMENT_SIZE["bfloat16"], b.ws
    slots = -(-c_ht // ws)
    for which in ("routed", "all_reduce"):
        b.symmetric(f"cutedsl.ht.{which}_ready", (slots,), f"ceil({c_ht}/ws)", 4, True)
        b.small(f"cutedsl.ht.{which}_processed", slots * ws, 4, f"uint32[ceil({c_ht}/ws), ws]")
    b.symmetric("cutedsl.ht.local", (c_ht, h), f"{c_ht}*H", bf16, False)
    b.symmetric("cutedsl.ht.prenorm", (c_ht, h), f"{c_ht}*H", bf16, False)


def _cutedsl_plan(t: Traits, req: Request, facts: Facts, version: str,
                  apply_norm: bool) -> Union[Plan, PassThrough]:
    """Allocator D: the workspace's symmetric buffers (each one torch symmetric-memory
    block, allocator C's rule, plus the rendezvous' pointer arrays) and its small
    caching-allocator tensors, protocol by protocol (reference §3-D, §4.3)."""
    found = _cutedsl_profile(t, req, facts, version, apply_norm)
    if isinstance(found, PassThrough):
        return found
    tables, profile, capacity, top_k, cc = found
    kind = tables.ProtocolKind
    ws, h = req.world_size, req.hidden_dim
    b = _Buffers(facts, ws)
    if not apply_norm:
        b.small("cutedsl.gamma_placeholder", h, ELEMENT_SIZE["bfloat16"], "bf16[H]")
    c_ll, c_bt, c_ht = capacity[kind.LL], capacity[kind.BT], capacity[kind.HT]
    if c_ll is not None:
        _ll_buffers(b, profile, kind, c_ll, h)
    if c_bt is not None:
        _bt_buffers(b, c_bt, h)
    if c_ht is not None:
        _ht_buffers(b, c_ht, h)
    notes = [f"capacities LL={c_ll} BT={c_bt} HT={c_ht} (FlashInfer {version} profile "
             f"tp={ws} H={h} top_k={top_k} cc={cc})"]
    if facts.multicast_all_ranks is False:
        notes.append("a peer lacks multicast: torch leaves the multicast pointer 0 and "
                     "FlashInfer raises RuntimeError after the first multicast buffer")
    return Plan(version, t.label, "unified", "mnnvl-cutedsl", "D", "posix", None,
                tuple(b.allocations), ws, req.dtype, tuple(notes))
