"""The conformance grid and one-case runner: FlashInfer's real creation code under the
recording stand-ins, compared byte for byte with our plan."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from typing import Optional

import torch

from flashinfer_safe_workspace.planning import facts as _facts, rules
from flashinfer_safe_workspace.planning.plan import Facts, PassThrough, Request, Unplanned

from .standins import Case, FakeComm, Recorder, cutedsl_device

MiB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# ---------------------------------------------------------------- the grid

WORLD_SIZES = (2, 4, 8, 16)
TOKENS = (1, 127, 2048, 16384)  # 16384 with ws >= 8 and H = 12288 passes MAX_COMM_SIZE
HIDDEN = (5120, 7168, 12288, 4097)  # 4097: odd, so 16/32-byte pre-rounding shows
SHAPES = [(ws, t, h, d) for ws in WORLD_SIZES for t in TOKENS for h in HIDDEN
          for d in ("bfloat16", "float16", "float32")]

# Device facts the stand-ins answer with.
FACTS = {
    "h200": dict(granularity=2 * MiB, multicast_granularity=512 * MiB),  # §9, POSIX
    # the driver's answer per object size (2 MiB for a 2 MiB object); the plan asks the
    # shim's own H200 rule (_facts.h200_multicast_granularity)
    "h200-per-size": dict(granularity=2 * MiB, multicast_granularity=512 * MiB,
                          multicast_by_size=True),
    "exact": dict(granularity=1, multicast_granularity=1),  # every byte of rounding shows
    "fabric-imex": dict(granularity=2 * MiB, multicast_granularity=2 * MiB,
                        fabric_supported=True, fabric_nvml_ok=True, imex_channel=True),
    "fabric-attr-only": dict(fabric_supported=True),  # H200 of §9: no NVML fabric, no IMEX
    "fabric-no-imex": dict(fabric_supported=True, fabric_nvml_ok=True),
    "no-multicast": dict(multicast_supported=False),
}

# What is called: (entry, backend, options).
ENTRIES = {
    "trtllm": ("unified", "trtllm", {}),
    "trtllm-oneshot": ("unified", "trtllm", {"force_oneshot_support": True}),
    "trtllm-cc": ("unified", "trtllm", {"cc": True}),
    "mnnvl": ("unified", "mnnvl", {}),
    "mnnvl-oneshot": ("unified", "mnnvl", {"force_oneshot_support": True}),
    "mnnvl-cc": ("unified", "mnnvl", {"cc": True}),
    "auto-all-multicast": ("unified", "auto", {"peers": True}),
    "auto-peer-without-multicast": ("unified", "auto", {"peers": False}),
    # FlashInfer rejects every grid case before allocating (tp size, dtype, or no
    # Blackwell GPU; "unknown backend" before 0.7.2.post1): checks nothing is allocated.
    "mnnvl-cutedsl": ("unified", "mnnvl-cutedsl", {}),
    # Shapes FlashInfer's profile tables accept, on a stand-in Blackwell device with
    # its CuTe DSL compiles stubbed (standins.cutedsl_device): allocator D.
    "mnnvl-cutedsl-accepted": ("unified", "mnnvl-cutedsl", {"blackwell": True}),
    "legacy": ("legacy", "trtllm", {"create_metadata": True}),
    "legacy-no-metadata": ("legacy", "trtllm", {}),
    "legacy-symm": ("legacy", "trtllm", {"use_symm_dev_mem": True, "create_metadata": True}),
    "legacy-symm-no-metadata": ("legacy", "trtllm", {"use_symm_dev_mem": True}),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    entry_name: str
    world_size: int
    rank: int
    tokens: int
    hidden: int
    dtype: str
    facts_name: str
    cc: Optional[tuple] = None  # compute capability the stand-ins report (None: Hopper)
    options: tuple = ()  # (name, value) keyword-only mnnvl-cutedsl options

    def label(self) -> str:
        extra = "".join(f" {n}={_CONFIG_NAMES.get(id(v), 'custom') if n == 'config' else v}"
                        for n, v in self.options)
        cc = f" cc={self.cc}" if self.cc else ""
        return (f"{self.entry_name} ws={self.world_size} r={self.rank} T={self.tokens} "
                f"H={self.hidden} {self.dtype}{cc}{extra} [{self.facts_name}]")


CUTEDSL_TOKENS = (1, 20, 100, 300, 2048)
CUTEDSL_CONFIGS = ("DEFAULT_CONFIG", "NO_NORM_CONFIG", "LL_ONLY_CONFIG", "BT_ONLY_CONFIG",
                   "HT_ONLY_CONFIG")


_CONFIG_NAMES: dict = {}  # id(config) -> its name in flashinfer.comm.mnnvl_cutedsl


def _named_config(name: str):
    from flashinfer.comm import mnnvl_cutedsl

    config = getattr(mnnvl_cutedsl, name)
    _CONFIG_NAMES[id(config)] = name
    return config


def cutedsl_grid() -> list:
    """Every profile of FlashInfer's own configs at a few token counts (some beyond a
    profile's routes: FlashInfer rejects those before allocating), with the options
    each config is measured for, plus FP8-output variants of the default config.

    Empty where FlashInfer's factory has no mnnvl-cutedsl options (before 0.7.2.post1:
    the ``mnnvl-cutedsl`` entry checks that it rejects the backend), whose profile
    tables, where present, are an earlier draft with other fields."""
    import flashinfer.comm

    factory = getattr(flashinfer.comm, "create_allreduce_fusion_workspace", None)
    if factory is None or "top_k" not in inspect.signature(factory).parameters:
        return []
    try:
        from flashinfer.comm import mnnvl_cutedsl

        for name in CUTEDSL_CONFIGS:
            _named_config(name)
    except (ImportError, AttributeError):  # a release without these tables
        return []
    specs = []
    i = 0
    for config_name in CUTEDSL_CONFIGS:
        config = _named_config(config_name)
        for profile in config.profiles:
            cc = profile.compute_capability or (10, 0)
            for tokens in CUTEDSL_TOKENS:
                variants = [()]
                if config_name == "NO_NORM_CONFIG":
                    variants = [(("apply_rms_norm", False),)]
                elif config_name == "DEFAULT_CONFIG":
                    fp8 = ("output_dtype", torch.float8_e4m3fn)
                    variants += [(fp8,), (fp8, ("dynamic_fp8", True),
                                          ("write_norm_output", True))]
                for extra in variants:
                    opts = (("top_k", profile.top_k),) + extra
                    if config_name != "DEFAULT_CONFIG" and config_name != "NO_NORM_CONFIG":
                        opts += (("config", config),)
                    rank = (i * 5 + 1) % profile.tp_size
                    i += 1
                    specs.append(Spec("mnnvl-cutedsl-accepted", profile.tp_size, rank,
                                      tokens, profile.hidden_size, "bfloat16", "h200",
                                      cc=cc, options=opts))
    # a custom config (NO_NORM_CONFIG's routes, for either norm setting) with the norm
    # and dynamic FP8: rejected where a route is the LL two-shot, planned elsewhere
    either = dataclasses.replace(mnnvl_cutedsl.NO_NORM_CONFIG, applies_rms_norm=None)
    _CONFIG_NAMES[id(either)] = "NO_NORM_CONFIG(applies_rms_norm=None)"
    for profile in either.profiles:
        for tokens in CUTEDSL_TOKENS:
            opts = (("top_k", profile.top_k), ("config", either),
                    ("output_dtype", torch.float8_e4m3fn), ("dynamic_fp8", True))
            specs.append(Spec("mnnvl-cutedsl-accepted", profile.tp_size, 1, tokens,
                              profile.hidden_size, "bfloat16", "h200",
                              cc=profile.compute_capability or (10, 0), options=opts))
    # granularity 1: every byte of each block shows; and a shape with no profile
    specs.append(Spec("mnnvl-cutedsl-accepted", 8, 3, 2048, 8192, "bfloat16", "exact",
                      cc=(10, 0), options=(("top_k", 10),)))
    specs.append(Spec("mnnvl-cutedsl-accepted", 8, 3, 2048, 4096, "bfloat16", "h200",
                      cc=(10, 0)))
    return specs


def grid(entry_name: str) -> list:
    """Every shape under every facts variant."""
    if entry_name == "mnnvl-cutedsl-accepted":
        return cutedsl_grid()
    specs = []
    for i, (ws, t, h, d) in enumerate(SHAPES):
        rank = (i * 5 + 1) % ws  # varies; reaches ranks >= 8 (device mapping of R1)
        for facts_name in FACTS:
            specs.append(Spec(entry_name, ws, rank, t, h, d, facts_name))
    return specs


# ---------------------------------------------------------------- one case


@dataclasses.dataclass
class Outcome:
    spec: Spec
    status: str  # "match" | "passthrough" | "unplanned" | "mismatch"
    detail: str = ""
    captured: Optional[list] = None
    plan: object = None


def _case_and_facts(spec: Spec) -> tuple:
    entry, backend, opts = ENTRIES[spec.entry_name]
    raw = dict(FACTS[spec.facts_name])
    case = Case(world_size=spec.world_size, rank=spec.rank, **raw)
    peers = opts.get("peers")
    case.peers_multicast = peers
    all_mc = case.multicast_supported and (peers if peers is not None else True)
    facts = Facts(
        granularity=case.granularity,
        multicast_granularity=case.multicast_granularity,
        fabric_supported=case.fabric_supported,
        fabric_nvml_ok=case.fabric_nvml_ok,
        multicast_supported=case.multicast_supported,
        multicast_all_ranks=all_mc,
        confidential_compute=bool(opts.get("cc")),
        current_device=case.current_device,
        device_count=case.device_count,
        # the installed torch's pad, through the shim's own lookup (the stand-in of
        # torch's allocator asks torch directly: standins.torch_signal_pad)
        torch_signal_pad=(_facts.signal_pad()[0] if case.torch_signal_pad is None
                          else case.torch_signal_pad),
        imex_channel=case.imex_channel,
        **({"compute_capability": tuple(spec.cc)} if spec.cc else {}),
        **({"multicast_granularity_for": _facts.h200_multicast_granularity}
           if case.multicast_by_size else {}),
    )
    return case, facts


def _set_confidential_compute(flashinfer, on: bool) -> None:
    os.environ["FLASHINFER_CONFIDENTIAL_COMPUTE"] = "1" if on else "0"
    reset_confidential_compute_cache(flashinfer)


def reset_confidential_compute_cache(flashinfer) -> None:
    fn = getattr(getattr(flashinfer, "utils", None), "is_confidential_compute", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


def call_flashinfer(flashinfer, spec: Spec, case: Case):
    """Call FlashInfer's creation entry for ``spec``; returns (request, result)."""
    entry, backend, opts = ENTRIES[spec.entry_name]
    comm = FakeComm(spec.rank, spec.world_size, opts.get("peers"))
    comm_mod = flashinfer.comm
    if entry == "unified":
        kwargs = dict(backend=backend, world_size=spec.world_size, rank=spec.rank,
                      max_token_num=spec.tokens, hidden_dim=spec.hidden,
                      dtype=DTYPES[spec.dtype],
                      force_oneshot_support=bool(opts.get("force_oneshot_support")))
        cutedsl = backend == "mnnvl-cutedsl"
        if not cutedsl:  # mnnvl-cutedsl refuses comm_backend (it uses a process group)
            kwargs["comm_backend"] = comm
        kwargs.update(dict(spec.options))
        req = Request("unified", backend, spec.world_size, spec.rank, spec.tokens,
                      spec.hidden, spec.dtype,
                      force_oneshot_support=bool(opts.get("force_oneshot_support")),
                      has_comm_backend=not cutedsl,
                      # as _decide.build_request normalises them
                      cutedsl_options=tuple(sorted((n, repr(v)) for n, v in spec.options)),
                      cutedsl_values=tuple(sorted(spec.options, key=lambda item: item[0])))
        fn = getattr(comm_mod, "create_allreduce_fusion_workspace", None)
    else:
        fn = comm_mod.trtllm_create_ipc_workspace_for_all_reduce_fusion
        params = inspect.signature(fn).parameters
        fp32 = spec.dtype == "float32"
        kwargs = dict(tp_rank=spec.rank, tp_size=spec.world_size, max_token_num=spec.tokens,
                      hidden_dim=spec.hidden, use_fp32_lamport=fp32,
                      create_metadata=bool(opts.get("create_metadata")))
        symm = bool(opts.get("use_symm_dev_mem"))
        if symm:
            kwargs["use_symm_dev_mem"] = True  # a TypeError in 0.5.x: FlashInfer says so
        has_comm = "comm_backend" in params
        if has_comm:
            kwargs["comm_backend"] = comm
        req = Request("legacy", "trtllm", spec.world_size, spec.rank, spec.tokens,
                      spec.hidden, None, use_fp32_lamport=fp32, use_symm_dev_mem=symm,
                      create_metadata=bool(opts.get("create_metadata")),
                      has_comm_backend=has_comm)
    return req, fn, kwargs


def run(flashinfer, rec: Recorder, spec: Spec, keep: list) -> Outcome:
    entry, backend, opts = ENTRIES[spec.entry_name]
    case, facts = _case_and_facts(spec)
    _set_confidential_compute(flashinfer, bool(opts.get("cc")))
    req, fn, kwargs = call_flashinfer(flashinfer, spec, case)
    try:
        plan = rules.plan_for(req, facts, flashinfer.__version__)
    except Unplanned as exc:
        return Outcome(spec, "unplanned", str(exc))
    error = None
    rec.start(case)
    device = (cutedsl_device(rec, spec.cc) if opts.get("blackwell")
              else contextlib.nullcontext())
    try:
        if fn is None:
            raise AttributeError("no create_allreduce_fusion_workspace in this release")
        with device, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keep.append(fn(**kwargs))
    except Exception as exc:  # noqa: BLE001 - FlashInfer's own rejection is data here
        error = exc
    captured = rec.stop()
    got = [r.key() for r in captured]
    if isinstance(plan, PassThrough):
        if error is None:
            return Outcome(spec, "mismatch", f"plan says pass-through ({plan.reason}) but "
                           f"FlashInfer created a workspace", captured, plan)
        if captured:
            return Outcome(spec, "mismatch", f"pass-through ({plan.reason}) but FlashInfer "
                           f"allocated before raising {error!r}: {got}", captured, plan)
        return Outcome(spec, "passthrough", f"{type(error).__name__}: {plan.reason}",
                       captured, plan)
    want = [(a.api, a.bytes, a.handle_type, a.held) for a in plan.allocations]
    export_fails = any("IMEX" in n and "fails" in n for n in plan.notes)
    if export_fails:
        # B1–B3, FABRIC without IMEX: FlashInfer raises after the first cuMemCreate
        ok = error is not None and isinstance(error, RuntimeError) and got == want[:1]
        return Outcome(spec, "match" if ok else "mismatch",
                       "" if ok else f"expected RuntimeError after {want[:1]}, got {error!r} "
                       f"and {got}", captured, plan)
    if error is not None:
        return Outcome(spec, "mismatch", f"FlashInfer raised {error!r}; planned {want}",
                       captured, plan)
    if got != want:
        return Outcome(spec, "mismatch", "allocations differ:\n  captured "
                       f"{got}\n  planned  {want}", captured, plan)
    expected_device = plan.device if plan.device is not None else facts.current_device
    devices = {r.device for r in captured if r.api == "cuMemCreate"}
    if devices and devices != {expected_device}:
        return Outcome(spec, "mismatch", f"allocated on cuda:{sorted(devices)}, planned "
                       f"cuda:{expected_device}", captured, plan)
    return Outcome(spec, "match", "", captured, plan)


def summarize(outcomes: list) -> dict:
    counts = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts
