"""Decide one creation call: plan, probe, vote, then create on every rank or on none."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import threading
import time
from typing import Callable, Optional

from . import _config, _probe, _vote
from ._log import internal_error, logger, rank_tag
from ._plan import Facts, MiB, PassThrough, Plan, Request, Unplanned
from .rules import plan_for as make_plan

UNIFIED = "unified"
LEGACY = "legacy"

_call_lock = threading.RLock()  # two threads of one process: serialised, one vote each
_veto_cache: dict = {}  # (entry, ranks, backend, digest) -> VetoInfo
_fast_vetoes: dict = {}  # fast_key(call) -> VetoInfo, filled only from completed votes
_version_warned: set = set()
last_report: dict = {}  # the latest decision of this process, for the demo and doctor


@dataclasses.dataclass
class VetoInfo:
    message: str
    ranks: tuple
    details: tuple


@dataclasses.dataclass
class Decision:
    """What the wrapper does: ``call`` the original, or ``veto``."""

    action: str  # "call" | "veto"
    reason: str = ""
    veto: Optional[VetoInfo] = None
    plan: Optional[Plan] = None
    channel: Optional[_vote.Channel] = None
    voted: tuple = ()


# --------------------------------------------------------------------------- arguments


def _dtype_name(dtype) -> Optional[str]:
    if dtype is None:
        return None
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


@functools.lru_cache(maxsize=32)
def _signature(original: Callable) -> inspect.Signature:
    return inspect.signature(original)


def fast_key(entry: str, original: Callable, args: tuple, kwargs: dict):
    """A key for the per-call veto cache, or None when the arguments are unhashable."""
    try:
        key = (entry, id(original), args, tuple(sorted(kwargs.items())))
        hash(key)
        return key
    except TypeError:
        return None


def cached_veto(key) -> Optional[VetoInfo]:
    """A veto this exact call already got from a completed vote (no work, no collective)."""
    return _fast_vetoes.get(key) if key is not None else None


def build_request(entry: str, original: Callable, args: tuple, kwargs: dict):
    """Bind the call to FlashInfer's own signature; ``None`` if it does not bind
    (FlashInfer will raise its own TypeError)."""
    try:
        bound = _signature(original).bind(*args, **kwargs)
    except TypeError:
        return None, None
    bound.apply_defaults()
    a = bound.arguments
    if entry == UNIFIED:
        cutedsl = tuple(sorted(
            (name, repr(value)) for name, value in a.items()
            if name in _CUTEDSL_OPTIONS and value is not None))
        req = Request(
            entry=UNIFIED, backend=a.get("backend", "auto"), world_size=a.get("world_size"),
            rank=a.get("rank"), max_token_num=a.get("max_token_num"),
            hidden_dim=a.get("hidden_dim"), dtype=_dtype_name(a.get("dtype")),
            force_oneshot_support=bool(a.get("force_oneshot_support", False)),
            gpus_per_node=a.get("gpus_per_node"),
            has_comm_backend=a.get("comm_backend") is not None, cutedsl_options=cutedsl,
            cutedsl_values=tuple(sorted(
                ((name, value) for name, value in a.items()
                 if name in _CUTEDSL_OPTIONS and value is not None), key=lambda item: item[0])))
    else:
        req = Request(
            entry=LEGACY, backend="trtllm", world_size=a.get("tp_size"), rank=a.get("tp_rank"),
            max_token_num=a.get("max_token_num"), hidden_dim=a.get("hidden_dim"),
            dtype="float32" if a.get("use_fp32_lamport") else None,
            use_fp32_lamport=bool(a.get("use_fp32_lamport", False)),
            use_symm_dev_mem=bool(a.get("use_symm_dev_mem", False)),
            create_metadata=bool(a.get("create_metadata", False)),
            has_comm_backend=a.get("comm_backend") is not None)
    return req, a


_CUTEDSL_OPTIONS = frozenset({
    "top_k", "rms_eps", "weight_bias", "routed_scaling_factor", "include_shared_expert",
    "add_residual", "write_residual_output", "apply_rms_norm", "output_dtype", "dynamic_fp8",
    "write_norm_output", "config"})


def flashinfer_version() -> str:
    module = sys.modules.get("flashinfer")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version
            version = dist_version("flashinfer-python")
        except Exception:
            version = "0.0.0"
    return str(version)


def _confidential_compute() -> bool:
    """FlashInfer's own answer where the release has it (it caches it)."""
    utils = sys.modules.get("flashinfer.utils")
    fn = getattr(utils, "is_confidential_compute", None)
    if fn is not None:
        return bool(fn())
    return _config.flashinfer_confidential_compute_override() == "1"


def _capturing() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


# --------------------------------------------------------------------------- the flow


def _uses_comm_backend(req: Request) -> bool:
    if req.entry == LEGACY:
        return req.use_symm_dev_mem
    return True  # unified: the comm_backend if given, else group/WORLD (mnnvl: MPI world)


def decide(entry: str, original: Callable, args: tuple, kwargs: dict,
           settings: _config.Settings, key=None) -> Decision:
    """Everything before FlashInfer runs. Never raises (our errors become a vote).
    ``key``: this call's ``fast_key``, under which a completed veto is remembered."""
    start = time.perf_counter()
    deadline = time.monotonic() + settings.vote_timeout  # bounds every wait below, together
    req, bound = build_request(entry, original, args, kwargs)
    if req is None:
        return Decision("call", "arguments do not bind; FlashInfer reports its own error")
    if _capturing():
        return Decision("call", "called during CUDA graph capture: no probe, FlashInfer decides")
    version = flashinfer_version()
    group = bound.get("group")
    comm_backend = bound.get("comm_backend")

    # 1. the channel over exactly the workspace's ranks (needed even to say no)
    try:
        if req.world_size == 1:
            channel = _vote.LocalChannel("world_size 1")  # nobody to vote with
        else:
            channel = _vote.choose_channel(
                group=group, comm_backend=comm_backend, uses_comm_backend=_uses_comm_backend(req),
                timeout_s=settings.vote_timeout)
    except Exception as exc:  # cannot reach peers: decide locally, fail closed or open
        internal_error("vote.channel", exc)
        if settings.fail_open:
            return Decision("call", f"no vote channel ({exc}); fail-open")
        return Decision("veto", "no vote channel", _veto_local(
            f"could not set up the vote group: {type(exc).__name__}: {exc}"))

    if _flashinfer_needs_a_process_group(req, channel):
        return Decision("call", "torch.distributed is not initialised and no comm_backend is "
                        "given: FlashInfer raises its own error before allocating")

    # 2. plan + probe on this rank; any failure of ours becomes this rank's "no"
    numbers: dict = {"global_rank": _global_rank(), "pid": os.getpid(), "device": -1}
    ok, plan, reason_code, note = _plan(req, version, channel, settings, numbers, deadline)
    if isinstance(plan, PassThrough):
        return Decision("call", plan.reason)
    if reason_code == _probe.UNKNOWN_VERSION and settings.unknown_version == "pass-through":
        return Decision("call", note)

    cache_key = (entry, channel.ranks, req.backend, plan.digest() if plan is not None else 0)
    cached = _veto_cache.get(cache_key)
    if cached is not None:  # same answer at once, no probe, no collective
        _log_cached(req, channel)
        return Decision("veto", "cached veto", cached, plan, channel)
    if ok and plan is not None:
        ok, reason_code, note = _run_probe(plan, settings, numbers)

    # 3. the vote
    if channel.size <= 1:
        result = _vote.VoteResult(ok, [], () if ok else (0,))
        result.records = [_vote.make_record(ok=int(ok), reason=reason_code,
                                            **_record_numbers(numbers))]
    else:
        result = _vote.vote(channel, ok=ok, digest=plan.digest() if plan is not None else 0,
                            timeout_s=_left(deadline), reason=reason_code,
                            **_record_numbers(numbers))
    elapsed_ms = (time.perf_counter() - start) * 1000
    last_report.clear()
    last_report.update(
        plan_bytes=plan.peak_bytes if plan is not None else -1,
        headroom_bytes=settings.headroom_bytes, free_bytes=numbers.get("free_bytes", -1),
        device=numbers.get("device", -1), probe_ok=bool(ok), probe_ms=numbers.get("probe_ms", 0.0),
        vote="yes" if result.passed else "no", vote_ms=result.elapsed_s * 1000,
        ranks=list(channel.ranks), elapsed_ms=elapsed_ms, note=note,
        no_ranks=[channel.ranks[p] for p in result.no_ranks], missing=result.missing,
        absent=list(result.absent))
    if result.passed:
        _log_decision("pass", req, plan, channel, numbers, ok, elapsed_ms)
        return Decision("call", "every rank voted yes", None, plan, channel, channel.ranks)
    veto = _explain(result, channel, plan, note)
    last_report["message"] = veto.message
    if not result.missing:  # a vote that completed is the same on every rank: cache it
        _veto_cache[cache_key] = veto
        if key is not None:
            _fast_vetoes[key] = veto
    _log_decision("veto", req, plan, channel, numbers, ok, elapsed_ms)
    logger.warning("flashinfer_safe_workspace %s: vetoed FlashInfer all-reduce workspace "
                   "creation on every rank: %s", rank_tag(), veto.message)
    return Decision("veto", veto.message, veto, plan, channel)


def _record_numbers(numbers: dict) -> dict:
    return {k: v for k, v in numbers.items() if k in _vote.FIELDS}


def _global_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return -1


def _run_probe(plan, settings, numbers):
    """(ok, reason code, note) of the probe on this rank; our failures are a "no"."""
    try:
        result = _probe.get_prober().probe(plan, settings.headroom_bytes)
    except _probe.ProbeUnavailable as exc:
        internal_error("probe.unavailable", exc)
        return settings.fail_open, _probe.NO_DEVICE, str(exc)
    except Exception as exc:  # the driver surprising us, or our bug
        internal_error("probe", exc)
        return settings.fail_open, _probe.PROBE_ERROR, f"{type(exc).__name__}: {exc}"
    numbers.update(probe_ms=result.elapsed_s * 1000, device=result.device,
                   free_bytes=result.free_bytes, failed_bytes=result.failed_bytes,
                   cuda_error=result.cuda_error,
                   failed_headroom=int(result.failed_name == "headroom"))
    return result.ok, result.reason, result.failed_name


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _plan(req, version, channel, settings, numbers, deadline):
    """(ok, plan | PassThrough | None, reason code, note): everything up to the probe."""
    from . import rules as _releases

    plan = None
    try:
        unknown = _releases.is_unknown(version)
    except Unplanned as exc:
        return settings.fail_open, None, _probe.UNPLANNED, str(exc)
    if unknown:
        if version not in _version_warned:
            _version_warned.add(version)
            logger.warning("flashinfer_safe_workspace %s: FlashInfer %s is newer than the newest "
                           "release mirrored (%s); UNKNOWN_VERSION=%s", rank_tag(), version,
                           ".".join(map(str, _releases.NEWEST[:3])), settings.unknown_version)
        if settings.unknown_version == "pass-through":
            return True, None, _probe.UNKNOWN_VERSION, f"FlashInfer {version} not mirrored; pass-through"
        if settings.unknown_version == "veto":
            return False, None, _probe.UNKNOWN_VERSION, f"FlashInfer {version} not mirrored; veto"
    try:  # arguments FlashInfer rejects before allocating: no device work at all
        early = make_plan(req, Facts(), version)
        if isinstance(early, PassThrough):
            return True, early, _probe.OK, early.reason
    except Exception:  # noqa: BLE001 - the full path below reports it
        pass
    try:
        prober = _probe.get_prober()
        cc = _confidential_compute() if req.entry == UNIFIED else False
        mismatch = _group_mismatch(req, channel)
        ws = req.world_size if isinstance(req.world_size, int) else 1
        facts = prober.facts(None, cc, ws)
        if _releases.needs_group_multicast_vote(req, version) and isinstance(req.world_size, int):
            if req.world_size > 1 and channel.size == req.world_size:
                everyone = _vote.agree_all(channel, facts.multicast_supported, _left(deadline))
            elif req.world_size <= 1:
                everyone = facts.multicast_supported
            else:
                everyone = False  # FlashInfer: comm size != world_size -> no mnnvl, no collective
            facts = dataclasses.replace(facts, multicast_all_ranks=everyone)
        facts = _size_aware_multicast(facts, prober, ws)
        plan = make_plan(req, facts, version)
        if isinstance(plan, PassThrough):
            return True, plan, _probe.OK, plan.reason
        numbers.update(peak_bytes=plan.peak_bytes, headroom_bytes=settings.headroom_bytes)
        if mismatch:
            return False, plan, _probe.ARG_MISMATCH, mismatch
        return True, plan, _probe.OK, ""
    except _vote.VoteTimeout as exc:
        return False, plan, _probe.INTERNAL_ERROR, str(exc)
    except Unplanned as exc:
        internal_error("plan", exc)
        return settings.fail_open, plan, _probe.UNPLANNED, str(exc)
    except _probe.ProbeUnavailable as exc:
        internal_error("probe.unavailable", exc)
        return settings.fail_open, plan, _probe.NO_DEVICE, str(exc)
    except Exception as exc:  # our own bug, or the driver surprising us
        internal_error("plan-and-probe", exc)
        return settings.fail_open, plan, _probe.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"


def _size_aware_multicast(facts, prober, world_size):
    """Facts whose multicast granularity is asked of the driver per object size."""
    query = getattr(prober, "multicast_granularity", None)
    if query is None:
        return facts
    handle = "fabric" if facts.fabric_supported and facts.imex_channel else "posix"
    answers: dict = {}

    def for_size(size: int):
        if size not in answers:
            answers[size] = query(None, world_size, size, handle)
        return answers[size]

    return dataclasses.replace(facts, multicast_granularity_for=for_size)


def _flashinfer_needs_a_process_group(req: Request, channel: _vote.Channel) -> bool:
    """The trtllm workspace of a multi-rank group exchanges through torch.distributed
    (``TorchDistBackend``, or symmetric memory on WORLD) unless a comm_backend is given;
    without an initialised process group FlashInfer raises before allocating anything."""
    return (isinstance(channel, _vote.LocalChannel) and channel.label == _vote.NO_PROCESS_GROUP
            and isinstance(req.world_size, int) and req.world_size > 1
            and not req.has_comm_backend
            and (req.entry == LEGACY or req.backend == "trtllm"))


def _group_mismatch(req: Request, channel: _vote.Channel) -> str:
    if isinstance(channel, _vote.LocalChannel):
        return ""
    if isinstance(req.world_size, int) and req.world_size != channel.size:
        return (f"world_size={req.world_size} but the group FlashInfer will use has "
                f"{channel.size} ranks")
    if isinstance(req.rank, int) and req.rank != channel.index:
        return f"rank={req.rank} but this process is rank {channel.index} of the group"
    return ""


def _veto_local(message: str) -> VetoInfo:
    return VetoInfo(message, (), ())


def _explain(result: _vote.VoteResult, channel: _vote.Channel, plan: Optional[Plan],
             note: str) -> VetoInfo:
    if result.missing:
        msg = (f"the vote over ranks {list(channel.ranks)} ({channel.label}) did not complete: "
               f"{result.missing}")
        return VetoInfo(msg, (), (msg,))
    details = []
    for pos in result.no_ranks:
        details.append(_describe_rank(result.records[pos], channel.ranks[pos], plan))
    for pos in result.digest_mismatch:
        details.append(f"rank {channel.ranks[pos]}: called with different arguments "
                       "(plan digest differs from the other ranks)")
    for pos in result.stale:
        details.append(f"rank {channel.ranks[pos]}: answered after its deadline")
    ranks = tuple(channel.ranks[p] for p in result.no_ranks + result.digest_mismatch + result.stale)
    need = f" (plan {plan.peak_bytes / MiB:.1f} MiB per rank)" if plan is not None else ""
    msg = (f"FlashInfer all-reduce workspace not created on any rank{need}: "
           + "; ".join(details))
    return VetoInfo(msg, tuple(sorted(set(ranks))), tuple(details))


def _describe_rank(record, rank: int, plan: Optional[Plan]) -> str:
    f = lambda name: _vote.field(record, name)  # noqa: E731
    reason = f("reason")
    device = f"cuda:{f('device')}" if f("device") >= 0 else "cuda:?"
    free = f("free_bytes")
    free_text = f", {free / (1 << 30):.2f} GiB free" if free >= 0 else ""
    if reason in (_probe.OUT_OF_MEMORY, _probe.PROBE_ERROR):
        err = "CUDA_ERROR_OUT_OF_MEMORY" if f("cuda_error") == 2 else f"CUDA error {f('cuda_error')}"
        what = "the headroom" if f("failed_headroom") else "cuMemCreate"
        return (f"rank {rank} ({device}): {what} of {f('failed_bytes') / MiB:.1f} MiB failed: "
                f"{err}{free_text} (plan {f('peak_bytes') / MiB:.1f} MiB + headroom "
                f"{f('headroom_bytes') / MiB:.0f} MiB)")
    return f"rank {rank} ({device}): {_probe.REASON_TEXT.get(reason, f'reason {reason}')}"


def _log_decision(outcome, req, plan, channel, numbers, ok, elapsed_ms):
    logger.info(
        "fiws decision %s outcome=%s entry=%s backend=%s ranks=%s device=%s plan_bytes=%d "
        "free_bytes=%d probe=%s elapsed_ms=%.1f", rank_tag(), outcome, req.entry,
        plan.backend if plan is not None else req.backend,
        ",".join(map(str, channel.ranks)),
        f"cuda:{numbers['device']}" if numbers.get("device", -1) >= 0 else "-",
        plan.peak_bytes if plan is not None else -1,
        numbers.get("free_bytes", -1), "ok" if ok else "no", elapsed_ms)


def _log_cached(req, channel) -> None:
    logger.debug("fiws decision %s outcome=veto-cached entry=%s backend=%s ranks=%s",
                 rank_tag(), req.entry, req.backend, ",".join(map(str, channel.ranks)))


def clear_cache() -> None:
    _veto_cache.clear()
    _fast_vetoes.clear()
