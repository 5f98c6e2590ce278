"""A creation call's arguments: the normalised Request and its identity.

The identity is what every rank of the group must have called with (everything but the
rank index and the per-call objects such as ``group`` or ``comm_backend``): equal calls
meet in the same round, and the record carries the arguments themselves so that a rank
that called differently is named with both values.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Callable, Optional

from . import plan as _plan
from .plan import Request, digest, dtype_name

UNIFIED = "unified"
LEGACY = "legacy"

CUTEDSL_OPTIONS = frozenset({
    "top_k", "rms_eps", "weight_bias", "routed_scaling_factor", "include_shared_expert",
    "add_residual", "write_residual_output", "apply_rms_norm", "output_dtype", "dynamic_fp8",
    "write_norm_output", "config"})


@functools.lru_cache(maxsize=32)
def _signature(original: Callable) -> inspect.Signature:
    return inspect.signature(original)


@functools.lru_cache(maxsize=32)
def _keywords(original: Callable):
    """``(names, defaults)`` when every parameter of ``original`` can be passed by keyword
    (none positional-only, no ``*args``/``**kwargs``): a call with keywords alone then binds
    without ``inspect`` (what engines do). None otherwise."""
    params = _signature(original).parameters.values()
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return None
    return (tuple(p.name for p in params),
            {p.name: p.default for p in params if p.default is not p.empty})


def _bind(original: Callable, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in, as ``Signature.bind`` gives them;
    TypeError where it does not bind."""
    fast = None if args else _keywords(original)
    if fast is not None:
        names, defaults = fast
        if kwargs.keys() <= set(names) and all(n in kwargs or n in defaults for n in names):
            return {n: kwargs[n] if n in kwargs else defaults[n] for n in names}
    bound = _signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def build(entry: str, original: Callable, args: tuple, kwargs: dict):
    """Bind the call to FlashInfer's own signature: ``(Request, arguments)``, or
    ``(None, None)`` when it does not bind (FlashInfer will raise its own TypeError)."""
    try:
        a = _bind(original, args, kwargs)
    except TypeError:
        return None, None
    if entry == UNIFIED:
        cutedsl = tuple(sorted((name, value) for name, value in a.items()
                               if name in CUTEDSL_OPTIONS and value is not None))
        req = Request(
            entry=UNIFIED, backend=a.get("backend", "auto"), world_size=a.get("world_size"),
            rank=a.get("rank"), max_token_num=a.get("max_token_num"),
            hidden_dim=a.get("hidden_dim"), dtype=dtype_name(a.get("dtype")),
            force_oneshot_support=bool(a.get("force_oneshot_support", False)),
            gpus_per_node=a.get("gpus_per_node"),
            has_comm_backend=a.get("comm_backend") is not None,
            cutedsl_options=tuple((name, repr(value)) for name, value in cutedsl),
            cutedsl_values=cutedsl)
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


def summary(req: Request) -> dict:
    """The arguments every rank must share, as plain values (for records and messages)."""
    out = {"entry": req.entry, "backend": req.backend, "world_size": req.world_size,
           "max_token_num": req.max_token_num, "hidden_dim": req.hidden_dim, "dtype": req.dtype}
    if req.entry == UNIFIED:
        out.update(force_oneshot_support=req.force_oneshot_support,
                   gpus_per_node=req.gpus_per_node, comm_backend=req.has_comm_backend)
        if req.cutedsl_options:
            out["cutedsl"] = [list(pair) for pair in req.cutedsl_options]
    else:
        out.update(use_fp32_lamport=req.use_fp32_lamport, use_symm_dev_mem=req.use_symm_dev_mem,
                   create_metadata=req.create_metadata, comm_backend=req.has_comm_backend)
    return {k: (v if isinstance(v, (bool, int, float, str, list)) or v is None else repr(v))
            for k, v in out.items()}


_IDENTITIES: dict = {}  # Request -> its identity (a decision asks for it several times)


def identity(req: Request) -> str:
    """The digest of the arguments every rank must share (``summary``)."""
    try:
        found = _IDENTITIES.get(req)
    except TypeError:  # an argument that is not hashable: computed each time
        return digest(summary(req))
    if found is None:
        found = digest(summary(req))
        if len(_IDENTITIES) >= 256:
            _IDENTITIES.clear()
        _IDENTITIES[req] = found
    return found


def uses_comm_backend(req: Request) -> bool:
    if req.entry == LEGACY:
        return req.use_symm_dev_mem
    return True  # unified: the comm_backend if given, else group/WORLD (mnnvl: MPI world)


def needs_process_group(req: Request, process_group: bool) -> bool:
    """The trtllm workspace of a multi-rank group exchanges through torch.distributed
    (``TorchDistBackend``, or symmetric memory on WORLD) unless a comm_backend is given;
    without an initialised process group (``process_group`` False) FlashInfer raises
    before allocating anything."""
    return (not process_group
            and isinstance(req.world_size, int) and req.world_size > 1
            and not req.has_comm_backend
            and (req.entry == LEGACY or req.backend == "trtllm"))


# --------------------------------------------------------------------------- rules glue


def flashinfer_version() -> Optional[str]:
    from . import rules

    return rules.flashinfer_version()


def unknown_version(version: Optional[str]) -> bool:
    """A release whose source was not read (``rules.is_unknown``, as ``plan`` and ``doctor``
    say it): ``UNKNOWN_VERSION`` decides."""
    from . import rules

    if version is None:
        return False
    try:
        return rules.is_unknown(version)
    except Exception:  # noqa: BLE001 - no version at all: the plan says Unplanned
        return False


def unverified_why(version: str) -> str:
    """Why ``version`` is not verified, in a few words (the runtime's warning)."""
    from . import rules

    try:
        return rules.unverified_why(version)
    except Exception:  # noqa: BLE001 - a warning's words, never an error
        return "not a release whose source was read"


def auto_by_vote(req: Request, version: Optional[str]) -> bool:
    from . import rules

    try:
        return bool(version) and rules.needs_group_multicast_vote(req, version)
    except Exception:  # noqa: BLE001
        return False


def plan_for(req: Request, facts, version: Optional[str]):
    from . import rules

    if version is None:
        raise _plan.Unplanned("FlashInfer's version cannot be read (is flashinfer installed?)")
    return rules.plan_for(req, facts, version)


def facts_for(req: Request, members=None):
    """This rank's facts from the runtime (driver, FlashInfer, torch's signal pad)."""
    from . import facts as _facts, probe as _probe

    cc = _confidential_compute() if req.entry == UNIFIED else False
    ws = req.world_size if isinstance(req.world_size, int) else 1
    return _facts.runtime_facts(_probe.get_prober(), confidential_compute=cc, world_size=ws)


def _confidential_compute() -> bool:
    """FlashInfer's own answer where the release has it (it caches it)."""
    from .. import _config

    utils = sys.modules.get("flashinfer.utils")
    fn = getattr(utils, "is_confidential_compute", None)
    if fn is not None:
        return bool(fn())
    return _config.flashinfer_confidential_compute_override() == "1"


def headroom(settings, req: Request, bound: dict):
    """(bytes, why) of the headroom for this call (``_headroom``: the group decides)."""
    from . import headroom as _headroom

    return _headroom.resolve(settings.headroom_mb, entry=req.entry, backend=req.backend,
                             group=bound.get("group"), comm_backend=bound.get("comm_backend"),
                             use_symm_dev_mem=req.use_symm_dev_mem)
