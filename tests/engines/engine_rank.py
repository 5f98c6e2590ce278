"""One rank of an engine-compatibility run (started by the tests, one process per rank).

    python engine_rank.py ENGINE VERSION ROOT RANK WORLD PORT SCENARIO FREE_MB

ROOT holds the engine's real files, fetched from its wheel (``_wheels.fetch``); they
are imported under their real module names (their parent packages are namespace
packages: no ``__init__.py`` is fetched, so nothing else of the engine loads). The
few modules they import that need the rest of the engine (or a GPU) are replaced by
the stand-ins below, each with the reason. The shim is activated the production way
(``FLASHINFER_SAFE_WORKSPACE=1`` in the environment, so the installed ``.pth`` runs; a rank
forked from the test fork server, ``_runner.FRESH`` says which, makes the ``.pth`` line's call
itself before this script runs),
FlashInfer is the installed one, the vote runs over real gloo groups, and the GPU is
a ``SimulatedDevice`` with FREE_MB free MiB. Prints one JSON line.

Two test-only variables serve the vLLM 0.22.0 run (failure mode 1): ``FIWS_ENGINE_TP``
lays the ranks out as TP x DP, and ``FIWS_ENGINE_PLAN_FLASHINFER`` is the FlashInfer
release the shim plans for (set as FlashInfer's ``__version__`` in the rank).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import strict  # noqa: E402
from _engines import APH_PASS, VLLM_PASS, literal  # noqa: E402

strict.install()  # an internal error of ours fails the run (tests/strict.py)

MiB = 1 << 20


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.items = []

    def emit(self, record):
        try:
            self.items.append({"logger": record.name, "level": record.levelname,
                               "msg": record.getMessage()})
        except Exception:
            pass


RECORDS = Records()


def _module(name: str, why: str, **attrs) -> types.ModuleType:
    """Register a stand-in module (``why`` is kept on it: ``__standin__``)."""
    mod = types.ModuleType(name)
    mod.__standin__ = why
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc),
            "where": traceback.extract_tb(exc.__traceback__)[-1].filename.rsplit("/", 1)[-1]}


# --------------------------------------------------------------------------- GPU stand-ins


class SimulatedDriver:
    """The CUDA driver calls SGLang's own preflight makes (``get_cuda_driver_bindings``),
    answered for the same simulated GPU as the shim's ``SimulatedDevice``: FREE bytes
    free, 2 MiB allocation granularity, 512 MiB multicast granularity (H200 values).
    Types and enums are the real ``cuda.bindings.driver`` ones; only the four calls
    that would need a driver are answered here. Stand-in because CI has no GPU."""

    def __init__(self, free_bytes: int):
        from cuda.bindings import driver

        self._real = driver
        self.free = free_bytes
        self.live = {}
        self.next = 1

    def __getattr__(self, name):  # structs and enums: the real ones
        return getattr(self._real, name)

    def cuMemGetAllocationGranularity(self, prop, flags):
        return self._real.CUresult.CUDA_SUCCESS, 2 * MiB

    def cuMulticastGetGranularity(self, prop, flags):
        return self._real.CUresult.CUDA_SUCCESS, 512 * MiB

    def cuMemCreate(self, size, prop, flags):
        if sum(self.live.values()) + int(size) > self.free:
            return self._real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        handle, self.next = self.next, self.next + 1
        self.live[handle] = int(size)
        return self._real.CUresult.CUDA_SUCCESS, handle

    def cuMemRelease(self, handle):
        self.live.pop(handle, None)
        return (self._real.CUresult.CUDA_SUCCESS,)


def simulate_gpu_for_engine(free_bytes: int) -> SimulatedDriver:
    """GPU questions engines ask directly, answered for the simulated H200 (no GPU here):
    ``torch.cuda.current_device()`` (CPU torch raises) is device 0, and FlashInfer's
    ``is_mnnvl_fabric_supported`` (needs a driver and NVML) says no fabric, as on an
    H200 without IMEX."""
    import torch
    import flashinfer.comm.mnnvl as mnnvl

    torch.cuda.current_device = lambda: 0
    mnnvl.is_mnnvl_fabric_supported = lambda device_idx: False
    return SimulatedDriver(free_bytes)


# --------------------------------------------------------------------------- vLLM


class _OnceLogger(logging.LoggerAdapter):
    """vLLM's logger API (``*_once`` methods) over a stdlib logger."""

    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self._seen = set()

    def _once(self, level, msg, *args, **kwargs):
        kwargs.pop("scope", None)
        key = (level, msg, args)
        if key in self._seen:
            return
        self._seen.add(key)
        self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *a, **k): self._once(logging.DEBUG, msg, *a, **k)
    def info_once(self, msg, *a, **k): self._once(logging.INFO, msg, *a, **k)
    def warning_once(self, msg, *a, **k): self._once(logging.WARNING, msg, *a, **k)
    def error_once(self, msg, *a, **k): self._once(logging.ERROR, msg, *a, **k)


class _Capability(tuple):
    def to_int(self):
        return self[0] * 10 + self[1]


def vllm_standins(root: Path, prefix: str = "vllm", pass_file: str = VLLM_PASS) -> None:
    """vLLM's stand-ins; ``prefix="aphrodite"`` for aphrodite-engine, a vLLM fork that
    keeps the module layout under its own namespace."""
    _module(f"{prefix}.logger", "vLLM's logger module configures logging through vllm.config "
            "(pydantic, transformers); the stand-in keeps its *_once API",
            init_logger=_OnceLogger)
    platform = types.SimpleNamespace(
        is_cuda=lambda: True, is_cuda_alike=lambda: True,
        get_device_capability=lambda device_id=0: _Capability((9, 0)),
        has_device_capability=lambda cap, device_id=0: 90 >= (
            cap if isinstance(cap, int) else cap[0] * 10 + cap[1]))
    _module(f"{prefix}.platforms", "no GPU on CI: the platform of a single-node H200 (SM 9.0)",
            current_platform=platform)
    table = literal(root / pass_file, "FI_ALLREDUCE_FUSION_MAX_SIZE_MB")

    class PassConfig:
        @staticmethod
        def default_fi_allreduce_fusion_max_size_mb():
            return table.get(90, {})

    _module(f"{prefix}.config.compilation", "the real module is vLLM's pydantic config; the "
            "stand-in serves the one method used, from the real table of the fetched "
            "fusion pass (SM 9.0 row)", PassConfig=PassConfig)
    aru = root / f"{prefix}/distributed/device_communicators/all_reduce_utils.py"
    if aru.exists():
        _module(f"{prefix}.distributed.device_communicators.all_reduce_utils",
                "the real module loads CUDA runtime wrappers; only its constant is used, "
                "read from the fetched file", FI_MNNVL_ALLREDUCE_MAX_SIZE_MB=literal(
                    aru, "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB"))
    _module(f"{prefix}.distributed.parallel_state", "the real module is vLLM's whole "
            "distributed runtime; every rank of this test runs on one host, which is what "
            "the real _node_count/get_node_count compute",
            _node_count=lambda group: 1, get_node_count=lambda: 1)


def drive_vllm_033(root, group, other_group, out):
    import torch

    fi = __import__("vllm.distributed.device_communicators.flashinfer_all_reduce",
                    fromlist=["_"])
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    kw = dict(world_size=world, rank=rank, max_token_num=1024, hidden_dim=4096,
              dtype=torch.bfloat16)
    # 1. the fusion pass and the Gemma op: get_fi_ar_workspace(group=TP cpu_group)
    try:
        ws = fi.get_fi_ar_workspace(group=group, **kw)
        out["workspace"] = repr(ws)
    except Exception as exc:
        out["workspace_error"] = _error(exc)
    out["failed_latch"] = fi._fi_ar_workspace_failed
    out["none_registered"] = id(None) in fi._fi_ar_workspace_groups
    # 2. asked again (every Gemma layer, the standalone path): the latch answers
    out["again"] = repr(fi.get_fi_ar_workspace(group=group, **kw))
    # 3. the standalone all-reduce (on by default in 0.33) on the same group
    far = fi.FlashInferAllReduce(group=group, device=0)
    out["standalone_enabled_before"] = not far.disabled
    out["standalone_ensure"] = far._ensure_workspace(4096, torch.bfloat16)
    out["standalone_disabled"] = far.disabled
    # 4. the quant workspace requested for another group over the same ranks
    try:
        out["quant_other_group"] = repr(fi.get_fi_ar_quant_workspace(group=other_group, **kw))
    except Exception as exc:
        out["quant_other_group_error"] = _error(exc)


def drive_vllm_018(root, group, other_group, out):
    import torch

    fi = __import__("vllm.distributed.device_communicators.flashinfer_all_reduce",
                    fromlist=["_"])
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    # the pass sizes the workspace as the standalone path does: max size // (H * 2)
    table = sys.modules["vllm.config.compilation"].PassConfig.default_fi_allreduce_fusion_max_size_mb()
    tokens = int(table[world] * MiB) // (4096 * 2)
    kw = dict(world_size=world, rank=rank, max_token_num=tokens, hidden_dim=4096,
              dtype=torch.bfloat16, group=group)
    # 1. what the fusion pass calls (inside its try/except Exception, checked by ast)
    try:
        fi.initialize_fi_ar_workspace(**kw)
        out["initialize"] = "returned"
    except Exception as exc:
        out["initialize_error"] = _error(exc)
    out["workspace"] = repr(fi.get_fi_ar_workspace())
    # 2. the standalone all-reduce: its own try/except around the same call
    far = fi.FlashInferAllReduce(group=group, device=0)
    out["standalone_enabled_before"] = not far.disabled
    out["standalone_ensure"] = far._ensure_workspace(4096, torch.bfloat16)
    out["standalone_disabled"] = far.disabled


def drive_vllm_family(prefix, group, other_group, out):
    """vLLM >= 0.20 and aphrodite-engine: ``get_fi_ar_workspace`` (what the fusion pass,
    the Gemma fused op and the standalone all-reduce call), asked twice, then the
    standalone all-reduce, then the quant workspace for another group."""
    import torch

    fi = __import__(f"{prefix}.distributed.device_communicators.flashinfer_all_reduce",
                    fromlist=["_"])
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    kw = dict(world_size=world, rank=rank, max_token_num=1024, hidden_dim=4096,
              dtype=torch.bfloat16)
    try:
        out["workspace"] = repr(fi.get_fi_ar_workspace(group=group, **kw))
    except Exception as exc:
        out["workspace_error"] = _error(exc)
    out["none_registered"] = id(None) in getattr(fi, "_fi_ar_workspace_groups", {})
    try:
        out["again"] = repr(fi.get_fi_ar_workspace(group=group, **kw))
    except Exception as exc:
        out["again_error"] = _error(exc)
    far = fi.FlashInferAllReduce(group=group, device=0)
    out["standalone_enabled_before"] = not far.disabled
    out["standalone_ensure"] = far._ensure_workspace(4096, torch.bfloat16)
    out["standalone_disabled"] = far.disabled
    try:
        out["quant_other_group"] = repr(fi.get_fi_ar_quant_workspace(group=other_group, **kw))
    except Exception as exc:
        out["quant_other_group_error"] = _error(exc)


# ------------------------------------------------ vLLM 0.22: TP x DP, FlashInfer's rendezvous

# The FlashInfer release the shim plans for in a run (test-only; unset: the installed one).
# The installed code is still what runs if the shim lets a call through.
PLAN_FOR = "FIWS_ENGINE_PLAN_FLASHINFER"
# Tensor-parallel size of a TP x DP layout over WORLD (test-only; the 0.22.0 driver: 2).
TP_SIZE = "FIWS_ENGINE_TP"

_TP_GROUPS: dict = {}


def tp_group_of_this_rank(tp: int):
    """This rank's TP group in a TP x DP layout over WORLD: ranks [0..tp-1], [tp..2tp-1],
    ... as vLLM's ``initialize_model_parallel`` lays them out with DP outside TP (every
    rank creates every group, in the same order: ``new_group`` is collective over WORLD).
    Built once per process, so each mode's run uses the same groups."""
    import torch.distributed as dist

    if tp not in _TP_GROUPS:
        world = dist.get_world_size()
        assert world % tp == 0, (world, tp)
        groups = [dist.new_group(list(range(s, s + tp)), backend="gloo")
                  for s in range(0, world, tp)]
        _TP_GROUPS[tp] = groups[dist.get_rank() // tp]
    return _TP_GROUPS[tp]


class RecordedWorkspace:
    """Stand-in for FlashInfer's workspace *classes* only (trtllm and mnnvl): reached only
    when the shim lets a call through and FlashInfer's real ``create_allreduce_fusion_
    workspace`` gets as far as allocating (CUDA, which CI has not); records the call."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.backend = "trtllm" if type(self) is RecordedWorkspace else "mnnvl"
        RecordedWorkspace.made.append(self.backend)

    def destroy(self):
        pass

    def __repr__(self):
        return f"<RecordedWorkspace backend={self.backend}>"


class _RecordedMnnvl(RecordedWorkspace):
    pass


class FlashInferEntries:
    """Counts entries into FlashInfer's own ``create_allreduce_fusion_workspace`` (the
    function under the shim's wrapper, unwrapped through ``__wrapped__``) with a profile
    hook on its code object: a spy, not a stand-in (FlashInfer runs if entered)."""

    def __init__(self):
        import flashinfer.comm.allreduce as ar

        fn = ar.create_allreduce_fusion_workspace
        while getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        self.code = fn.__code__  # the innermost: FlashInfer's own body
        self.count = 0

    def _hook(self, frame, event, arg):
        if event == "call" and frame.f_code is self.code:
            self.count += 1

    def __enter__(self):
        self._prev = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._prev)


def drive_vllm_tp_dp(tp_size, out):
    """vLLM 0.22's call sites on this rank's TP group of a TP x DP layout: what
    ``AllReduceFusionPass.__init__`` runs (``get_fi_ar_workspace``, and the quant workspace
    only when that returned a workspace; the pass's ``is None: return`` is checked in its
    source), then the standalone all-reduce (``FlashInferAllReduce._ensure_workspace``),
    each timed. FlashInfer's workspace classes are stand-ins (``RecordedWorkspace``); the
    entries into FlashInfer's own function are counted (``FlashInferEntries``)."""
    import time

    import torch
    import torch.distributed as dist
    import flashinfer
    import flashinfer.comm.allreduce as ar

    if os.environ.get(PLAN_FOR):
        flashinfer.__version__ = os.environ[PLAN_FOR]  # plan with that release's rules
    out["planned_for"] = flashinfer.__version__
    ar.TRTLLMAllReduceFusionWorkspace = RecordedWorkspace
    ar.MNNVLAllReduceFusionWorkspace = _RecordedMnnvl
    RecordedWorkspace.made = []
    tp = tp_group_of_this_rank(tp_size)
    out["tp_ranks"] = dist.get_process_group_ranks(tp)
    fi = __import__("vllm.distributed.device_communicators.flashinfer_all_reduce",
                    fromlist=["_"])
    world, rank = dist.get_world_size(tp), dist.get_rank(tp)
    # the pass's sizing: max size (SM 9.0 row of the real table) // (H * 2), at most
    # max_num_batched_tokens (8192 here)
    table = sys.modules["vllm.config.compilation"].PassConfig.default_fi_allreduce_fusion_max_size_mb()
    tokens = min(int(table[world] * MiB) // (4096 * 2), 8192)
    kw = dict(world_size=world, rank=rank, max_token_num=tokens, hidden_dim=4096,
              dtype=torch.bfloat16, group=tp)
    secs = []
    with FlashInferEntries() as entries:
        start = time.perf_counter()
        try:
            ws = fi.get_fi_ar_workspace(**kw)
            out["workspace"] = repr(ws)
        except Exception as exc:  # vLLM catches inside; anything here is reported
            ws, out["workspace_error"] = None, _error(exc)
        secs.append(time.perf_counter() - start)
        out["pass_disabled"] = ws is None
        if ws is not None:
            start = time.perf_counter()
            out["quant"] = repr(fi.get_fi_ar_quant_workspace(**kw))
            secs.append(time.perf_counter() - start)
        far = fi.FlashInferAllReduce(group=tp, device=dist.get_rank())
        out["standalone_enabled_before"] = not far.disabled
        start = time.perf_counter()
        out["standalone_ensure"] = far._ensure_workspace(4096, torch.bfloat16)
        secs.append(time.perf_counter() - start)
        out["standalone_disabled"] = far.disabled
    out["flashinfer_entries"] = entries.count
    out["workspaces_made"] = list(RecordedWorkspace.made)
    out["call_secs"] = secs


_VLLM_LIB, _VLLM_OPS = None, set()


def vllm_015_standins(root, coordinator):
    """vLLM 0.15's fusion pass module (``vllm/compilation/collective_fusion.py``) imports
    the compiler stack; the stand-ins give it what its import and ``__init__`` use."""
    import torch

    vllm_standins(root, pass_file="vllm/compilation/collective_fusion.py")
    sys.modules["vllm.platforms"].current_platform.fp8_dtype = lambda: torch.float8_e4m3fn
    _module("vllm.config", "pydantic config; only the type name is imported",
            VllmConfig=object)
    _module("vllm.config.utils", "config helpers; only the type name is imported",
            Range=object)
    _module("vllm.distributed", "vLLM's distributed runtime: the TP group (its "
            "device_group, NCCL in vLLM, is a gloo group here)",
            get_tp_group=lambda: coordinator, tensor_model_parallel_all_reduce=None)
    _module("vllm.distributed.parallel_state", "TP rank and size of this two-rank run",
            get_tensor_model_parallel_rank=lambda: coordinator.rank_in_group,
            get_tensor_model_parallel_world_size=lambda: coordinator.world_size)
    _module("vllm.model_executor", "package of the stand-in below",
            __path__=[str(root / "vllm/model_executor")])
    _module("vllm.model_executor.layers.quantization.utils.quant_utils", "quantization "
            "keys; only the name is imported", kFp8StaticTensorSym=None)
    global _VLLM_LIB
    if _VLLM_LIB is None:
        _VLLM_LIB = torch.library.Library("vllm", "FRAGMENT")

    def direct_register_custom_op(op_name, op_func, mutates_args=(), fake_impl=None, **kw):
        if op_name in _VLLM_OPS:  # the next mode re-imports the module: same op
            return
        _VLLM_OPS.add(op_name)
        _VLLM_LIB.define(op_name + torch.library.infer_schema(op_func, mutates_args=mutates_args))
        _VLLM_LIB.impl(op_name, op_func, "CPU")

    _module("vllm.utils.torch_utils", "vLLM's torch helpers; its op registration, "
            "written here with torch.library", direct_register_custom_op=direct_register_custom_op)
    _module("vllm.compilation.inductor_pass", "inductor plumbing; the decorator is only "
            "used on pattern registration, which is never reached",
            enable_fake_mode=lambda fn: fn)
    _module("vllm.compilation.matcher_utils", "pattern matchers; only names are imported",
            MatcherFusedAddRMSNorm=object, MatcherQuantFP8=object, MatcherRMSNorm=object)

    class VllmInductorPass:
        def __init__(self, config):
            self.model_dtype = config.model_config.dtype
            self.device = "cpu"

        @staticmethod
        def time_and_log(fn):
            return fn

    _module("vllm.compilation.vllm_inductor_pass", "the pass base classes; what __init__ "
            "reads from them is the model dtype", VllmInductorPass=VllmInductorPass,
            VllmPatternMatcherPass=VllmInductorPass)


def drive_vllm_015(root, group, other_group, out):
    """``AllReduceFusionPass(config)``: what vLLM 0.15 runs at its first torch.compile
    (the profile run, during start-up) with ``fuse_allreduce_rms`` on."""
    import torch

    mod = __import__("vllm.compilation.collective_fusion", fromlist=["_"])
    table = mod.FI_ALLREDUCE_FUSION_MAX_SIZE_MB[90]
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: 4096),
        compilation_config=types.SimpleNamespace(pass_config=types.SimpleNamespace(
            flashinfer_max_size=lambda world: int(table[world] * MiB))),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192))
    try:
        p = mod.AllReduceFusionPass(config)
        out["pass"] = {"disabled": p.disabled}
    except Exception as exc:
        out["pass_error"] = _error(exc)


# --------------------------------------------------------------------------- lmdeploy


def lmdeploy_standins(root):
    import torch
    import flashinfer.comm.cuda_ipc as cuda_ipc

    _module("lmdeploy", "the real package __init__ imports lmdeploy's whole API; this one "
            "only points at the fetched files", __path__=[str(root / "lmdeploy")])
    _module("lmdeploy.utils", "lmdeploy.utils imports most of lmdeploy; the one name used: "
            "get_logger (a stdlib logger)", get_logger=logging.getLogger)
    # the simulated H200: SM 9.0, device 0; FlashInfer's cudart binding needs libcudart
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    cuda_ipc.cudart = types.SimpleNamespace(cudaSetDevice=lambda device: None)


def drive_lmdeploy(group, out):
    """lmdeploy's ``FlashInferAllReduce`` (one per process group): the in-place all-reduce
    and the fused residual + RMSNorm, each twice; both create the workspace lazily."""
    import torch

    mod = __import__("lmdeploy.pytorch.backends.cuda.comm.flashinfer_allreduce",
                     fromlist=["_"])
    far = mod.FlashInferAllReduce(group)
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    out["all_reduce_first"] = far.all_reduce_(x)
    out["disabled"] = far._disabled
    out["all_reduce_second"] = far.all_reduce_(x)
    fused = far.fused_all_reduce_residual_rms_norm(
        x, torch.randn_like(x), torch.ones(4096, dtype=torch.bfloat16), 1e-6)
    out["fused"] = repr(fused)


# --------------------------------------------------------------------------- SGLang


class _Coordinator:
    """The fields of SGLang's GroupCoordinator the fusion code reads."""

    def __init__(self, device_group, cpu_group):
        import torch.distributed as dist

        self.device_group, self.cpu_group = device_group, cpu_group
        self.world_size = dist.get_world_size(cpu_group)
        self.rank_in_group = dist.get_rank(cpu_group)


def sglang_0523_standins(root, coordinator, driver, backend):
    _module("sglang.srt.distributed.device_communicators.custom_all_reduce_utils",
            "only consulted for mnnvl groups spanning hosts; this test is one host",
            is_one_nvlink_clique=lambda group, device: True)
    _module("sglang.srt.distributed.parallel_state", "the real module is SGLang's "
            "distributed runtime; every rank here is on one host",
            in_the_same_node_as=lambda pg, source_rank=0: [True] * coordinator.world_size)
    parallel = types.SimpleNamespace(
        attn_tp_size=coordinator.world_size, attn_tp_rank=coordinator.rank_in_group,
        attn_tp_group=coordinator, tp_group=coordinator, tp_size=coordinator.world_size,
        nnodes=1, moe_ep_size=1, moe_tp_size=coordinator.world_size)
    exec_ = types.SimpleNamespace(comm=types.SimpleNamespace(
        flashinfer_allreduce_fusion_backend=backend))
    platform = types.SimpleNamespace(is_sm90=True, is_sm100=False)
    resources = types.SimpleNamespace(buffers={})
    _module("sglang.srt.runtime_context", "the real context is built by the SGLang server "
            "from ServerArgs; this one publishes a TP=2 single-node Hopper run with "
            f"--flashinfer-allreduce-fusion-backend {backend}",
            get_exec=lambda: exec_, get_parallel=lambda: parallel,
            get_platform=lambda: platform, get_resources=lambda: resources)
    _module("sglang.srt.utils", "sglang.srt.utils imports most of SGLang; the three names "
            "used: ceil_align, the CUDA driver (simulated GPU, see SimulatedDriver), "
            "is_flashinfer_available (it is installed)",
            ceil_align=lambda x, y: -(-x // y) * y, get_cuda_driver_bindings=lambda: driver,
            is_flashinfer_available=lambda: True)
    _module("sglang.srt.layers.moe", "package of the stand-in below")
    _module("sglang.srt.layers.moe.utils", "the real module imports SGLang's MoE stack; "
            "dense TP model: post-expert reduction happens on the TP group",
            can_merge_post_experts_all_reduce=lambda: True,
            post_experts_reduction_group=lambda: coordinator)
    _custom_op_standin()


def _custom_op_standin():
    def register_custom_op(*args, **kwargs):
        return lambda fn: fn

    _module("sglang.srt.utils.custom_op", "registering a torch.library op is not needed "
            "to call the function eagerly", register_custom_op=register_custom_op)


def sglang_0510_standins(root, coordinator):
    ws, rank = coordinator.world_size, coordinator.rank_in_group
    _module("sglang.srt.distributed", "the real package is SGLang's distributed runtime; "
            "TP=2 attention and MoE groups on this one process group",
            get_attn_tensor_model_parallel_rank=lambda: rank,
            get_attn_tensor_model_parallel_world_size=lambda: ws,
            get_moe_expert_parallel_rank=lambda: 0,
            get_moe_expert_parallel_world_size=lambda: 1,
            get_moe_tensor_parallel_rank=lambda: rank,
            get_moe_tensor_parallel_world_size=lambda: ws)
    _module("sglang.srt.utils", "sglang.srt.utils imports most of SGLang; the one name "
            "used: is_flashinfer_available (it is installed)",
            is_flashinfer_available=lambda: True)
    _custom_op_standin()
    _module("sglang.srt.debug_utils.cuda_coredump", "imported by the real environ.py for "
            "CUDA core-dump settings; no GPU here")


def _op_call(fn):
    import torch

    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    try:
        res = fn(x, torch.randn_like(x), torch.ones(4096, dtype=torch.bfloat16))
        return {"returned": [None if t is None else "tensor" for t in res]}
    except Exception as exc:
        return {"raised": _error(exc)}


def _gloo_all_reduce(group):
    """The TP all-reduce (NCCL in SGLang) over the gloo group, in float32."""
    def all_reduce(t):
        import torch.distributed as dist

        total = t.float()
        dist.all_reduce(total, group=group)
        return total.to(t.dtype)
    return all_reduce


def sglang_modern_standins(root, coordinator, driver, backend="trtllm"):
    """SGLang 0.5.14-0.5.19: the fusion file and the real ``layernorm.py`` (the layer
    that calls the fused op and falls back on ``(None, None)``)."""
    ws, rank = coordinator.world_size, coordinator.rank_in_group
    _module("sglang.srt.distributed", "the real package is SGLang's distributed runtime; "
            "TP=2 on one process group: every getter returns the same coordinator",
            get_attn_tp_group=lambda: coordinator, get_moe_ep_group=lambda: coordinator,
            get_moe_tp_group=lambda: coordinator, get_tp_group=lambda: coordinator,
            tensor_model_parallel_all_reduce=_gloo_all_reduce(coordinator.cpu_group),
            tensor_model_parallel_fused_allreduce_rmsnorm=None)  # AMD aiter only
    _module("sglang.srt.distributed.parallel_state", "every rank here is on one host",
            in_the_same_node_as=lambda pg, source_rank=0: [True] * ws)
    parallel = types.SimpleNamespace(
        attn_tp_size=ws, attn_tp_rank=rank, tp_size=ws, nnodes=1, moe_ep_size=1,
        moe_ep_rank=0, moe_tp_size=ws, moe_tp_rank=rank)
    args = types.SimpleNamespace(flashinfer_allreduce_fusion_backend=backend, nnodes=1,
                                 enable_aiter_allreduce_fusion=False)
    exec_ = types.SimpleNamespace(comm=types.SimpleNamespace(
        flashinfer_allreduce_fusion_backend=backend))
    resources = types.SimpleNamespace(buffers={})
    _module("sglang.srt.runtime_context", "built by the SGLang server from ServerArgs; this "
            f"one is a TP=2 single-node Hopper run, --flashinfer-allreduce-fusion-backend "
            f"{backend}", get_parallel=lambda: parallel, get_server_args=lambda: args,
            get_exec=lambda: exec_, get_resources=lambda: resources,
            get_platform=lambda: types.SimpleNamespace(is_sm90=True, is_sm100=False))
    _module("sglang.srt.server_args", "the real module is the server's argument parser; "
            "the same run's arguments", get_global_server_args=lambda: args)
    no = lambda *a, **k: False  # noqa: E731
    _module("sglang.srt.utils", "sglang.srt.utils imports most of SGLang; the names used: "
            "ceil_align, the CUDA driver (simulated GPU), is_flashinfer_available (it is "
            "installed), SM 9.0, and for layernorm.py every platform predicate False so that "
            "it takes its torch-native path (no sgl_kernel on CPU)",
            ceil_align=lambda x, y: -(-x // y) * y, get_cuda_driver_bindings=lambda: driver,
            is_flashinfer_available=lambda: True, is_sm90_supported=lambda: True,
            is_sm100_supported=no, cpu_has_amx_support=no,
            get_bool_env_var=lambda name, default="false": False, is_cpu=no, is_cuda=no,
            is_hip=no, is_musa=no, is_npu=no, is_xpu=no, is_gfx1250_supported=no)
    _custom_op_standin()
    _module("sglang.srt.debug_utils.cuda_coredump", "imported by the real environ.py for "
            "CUDA core-dump settings; no GPU here")
    _module("sglang.srt.batch_invariant_ops", "batch-invariant kernels (Triton); off",
            is_batch_invariant_mode_enabled=no, rms_norm_batch_invariant=None)
    _module("sglang.srt.model_executor.cuda_graph_config", "CUDA graph capture settings; "
            "no graphs here", Backend=None, Phase=None, check_cuda_graph_backend=no)
    import torch

    class MultiPlatformOp(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

    _module("sglang.srt.layers.utils", "SGLang's per-platform dispatch base; on CPU it "
            "dispatches to forward_native, as here", MultiPlatformOp=MultiPlatformOp)
    _module("sglang.kernels.fused_op", "0.5.19's per-platform dispatch base (same role)",
            BaseFusedOp=MultiPlatformOp)


def drive_sglang_modern(root, group, other_group, out):
    """The runner's warm-up (``pre_initialize_workspaces``), then one decoder layer's
    norm twice, as the communicator runs it: with the all-reduce deferred to the fused
    norm while ``is_flashinfer_allreduce_unavailable()`` is False (the state-dependent
    term of ``communicator.apply_flashinfer_allreduce_fusion``, checked in its source),
    else all-reduce first, then the plain norm. Compared with the non-fused reference
    computed from the same inputs: all-reduce over the ranks, then the same RMSNorm."""
    import torch
    import torch.distributed as dist

    mod = __import__("sglang.srt.layers.flashinfer_comm_fusion", fromlist=["_"])
    ln = __import__("sglang.srt.layers.layernorm", fromlist=["_"])
    out["bound_is_wrapped"] = _is_ours(mod._create_allreduce_fusion_workspace)
    try:
        mod.pre_initialize_workspaces(2048, 4096, torch.bfloat16)
    except Exception as exc:
        out["warmup_error"] = _error(exc)
    manager = mod._get_workspace_manager(True)
    out["unavailable"] = mod.is_flashinfer_allreduce_unavailable()
    out["manager_initialized"] = manager.initialized
    out["manager_workspace"] = repr(manager.workspace)
    rank = dist.get_rank(group)
    norm = ln.RMSNorm(4096, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 4096))
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank's partial sums differ
    x = torch.randn(8, 4096, generator=gen).to(torch.bfloat16)
    residual = torch.randn(8, 4096, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    all_reduce = _gloo_all_reduce(group)
    with torch.no_grad():
        ref = norm.forward_native(all_reduce(x), residual.clone())
        unreduced = norm.forward_native(x.clone(), residual.clone())
        layers = []
        for _ in range(2):
            deferred = not mod.is_flashinfer_allreduce_unavailable()
            if deferred:
                got = norm.forward_with_allreduce_fusion(x.clone(), residual.clone())
            else:
                got = norm.forward(all_reduce(x), residual.clone())
            layers.append({
                "deferred_to_fused_norm": deferred,
                "matches_reference": bool(torch.allclose(got[0].float(), ref[0].float(),
                                                         atol=1e-2, rtol=1e-2)),
                "matches_unreduced": bool(torch.allclose(got[0].float(), unreduced[0].float(),
                                                         atol=1e-2, rtol=1e-2)),
                "max_abs_diff": float((got[0].float() - ref[0].float()).abs().max())})
    out["layers"] = layers
    out["unavailable_after"] = mod.is_flashinfer_allreduce_unavailable()


def sglang_058_standins(root, coordinator):
    _module("sglang.srt.distributed", "SGLang's distributed runtime: the TP size",
            get_tensor_model_parallel_world_size=lambda: coordinator.world_size)
    _module("sglang.srt.utils", "sglang.srt.utils imports most of SGLang; the one name "
            "used: is_flashinfer_available (it is installed)",
            is_flashinfer_available=lambda: True)
    _custom_op_standin()


def drive_sglang_058(root, group, other_group, out):
    """The fused residual + RMSNorm op, which creates the (legacy) workspace lazily at
    its first call, twice."""
    mod = __import__("sglang.srt.layers.flashinfer_comm_fusion", fromlist=["_"])
    out["op_first"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)
    out["manager_initialized"] = mod._workspace_manager.initialized
    out["op_second"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)


def drive_sglang_0523(root, group, other_group, out):
    mod = __import__("sglang.srt.layers.flashinfer_comm_fusion", fromlist=["_"])
    out["bound_is_wrapped"] = _is_ours(mod._create_allreduce_fusion_workspace)
    # the fused residual+RMSNorm op: creates the workspace lazily (pre_initialize_workspaces
    # in the runner calls ensure_workspace_initialized the same way)
    out["op_first"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)
    out["unavailable"] = mod.is_flashinfer_allreduce_unavailable()
    out["manager_initialized"] = mod._get_workspace_manager(True).initialized
    out["op_second"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)
    import torch

    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    coord = sys.modules["sglang.srt.runtime_context"].get_parallel().attn_tp_group
    out["can_use"] = mod.can_use_flashinfer_allreduce(
        x, use_attn_tp_group=True, expected_world_size=coord.world_size,
        expected_group_key=(coord.device_group, coord.cpu_group))


def drive_sglang_0510(root, group, other_group, out):
    mod = __import__("sglang.srt.layers.flashinfer_comm_fusion", fromlist=["_"])
    out["op_first"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)
    out["unavailable"] = mod.is_flashinfer_allreduce_unavailable()
    out["manager_initialized"] = mod._workspace_manager.initialized
    out["manager_workspace"] = repr(mod._workspace_manager.workspace)
    out["op_second"] = _op_call(mod.flashinfer_allreduce_residual_rmsnorm)


def _is_ours(fn) -> bool:
    from flashinfer_safe_workspace.activation import patch as _patch

    return _patch.is_ours(fn)


# --------------------------------------------------------------------------- main


DRIVERS = {}  # (engine, version) -> function(root, group, other, free_bytes, out)


def driver(engine, *versions):
    def register(fn):
        for v in versions:
            DRIVERS[(engine, v)] = fn
        return fn
    return register


def _engine_prefix(engine: str) -> str:
    return {"aphrodite-engine": "aphrodite"}.get(engine, engine)


def _purge(prefix: str) -> None:
    """Forget every module of the engine (real and stand-in): the next mode imports the
    real files afresh, with none of the previous mode's latches."""
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


class _Answers:
    """Records what ``_caller.resolve`` answered (it still answers: a spy, not a stand-in)."""

    def __init__(self):
        from flashinfer_safe_workspace import _caller

        self.items, self._real = [], _caller.resolve
        _caller.resolve = self

    def __call__(self, on_veto, entry, need_caller=True):
        # the caller is always looked up here, so every recorded answer names it (the
        # shim skips the look-up only where the answer does not depend on it)
        answer = self._real(on_veto, entry, need_caller=True)
        self.items.append({"kind": answer.kind, "caller": answer.caller, "why": answer.why})
        return answer


@driver("vllm", "0.33.0")
def run_vllm_033(root, group, other, free, out):
    vllm_standins(root)
    drive_vllm_033(root, group, other, out)


@driver("vllm", "0.18.0", "0.17.0")
def run_vllm_018(root, group, other, free, out):
    vllm_standins(root)
    drive_vllm_018(root, group, other, out)


@driver("vllm", "0.20.0", "0.26.0")
def run_vllm_family(root, group, other, free, out):
    vllm_standins(root)
    drive_vllm_family("vllm", group, other, out)


@driver("vllm", "0.22.0")
def run_vllm_022(root, group, other, free, out):
    vllm_standins(root)
    drive_vllm_tp_dp(int(os.environ.get(TP_SIZE, "2")), out)


@driver("aphrodite-engine", "0.24.1")
def run_aphrodite(root, group, other, free, out):
    vllm_standins(root, "aphrodite", APH_PASS)
    drive_vllm_family("aphrodite", group, other, out)


@driver("lmdeploy", "0.18.0")
def run_lmdeploy(root, group, other, free, out):
    lmdeploy_standins(root)
    drive_lmdeploy(group, out)


@driver("sglang", "0.5.14", "0.5.17", "0.5.19")
def run_sglang_modern(root, group, other, free, out):
    coordinator = _Coordinator(other, group)
    sglang_modern_standins(root, coordinator, simulate_gpu_for_engine(free))
    drive_sglang_modern(root, group, other, out)


@driver("vllm", "0.15.0")
def run_vllm_015(root, group, other, free, out):
    vllm_015_standins(root, _Coordinator(group, other))
    drive_vllm_015(root, group, other, out)


@driver("sglang", "0.5.8")
def run_sglang_058(root, group, other, free, out):
    sglang_058_standins(root, _Coordinator(other, group))
    drive_sglang_058(root, group, other, out)


@driver("sglang", "0.5.23")
def run_sglang_0523(root, group, other, free, out):
    coordinator = _Coordinator(other, group)  # device_group (NCCL in SGLang), cpu_group
    sglang_0523_standins(root, coordinator, simulate_gpu_for_engine(free), "trtllm")
    drive_sglang_0523(root, group, other, out)


@driver("sglang", "0.5.10.post1")
def run_sglang_0510(root, group, other, free, out):
    sglang_0510_standins(root, _Coordinator(other, group))
    drive_sglang_0510(root, group, other, out)




def main(argv):
    engine, version, root, rank, world, port, modes, free_mb = argv
    root, rank, world, free = Path(root), int(rank), int(world), int(free_mb) * MiB
    modes = modes.split(",")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    logging.getLogger().addHandler(RECORDS)
    import torch.distributed as dist

    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace import _decide
    from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
    from flashinfer_safe_workspace._log import parse_decision_lines

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    group = dist.new_group(list(range(world)), backend="gloo")  # the engine's TP cpu_group
    other = dist.new_group(list(range(world)), backend="gloo")  # another group, same ranks
    _probe.set_prober(SimulatedDevice(free, device=rank))
    answers = _Answers()
    sys.path.insert(0, str(root))
    result = {"rank": rank, "pid": os.getpid(), "engine": engine, "version": version,
              "modes": {}}
    for i, mode in enumerate(modes):
        # the first mode is the production activation (variable + .pth, ON_VETO from the
        # environment); later modes re-install in code, which clears the veto cache
        if i:
            fiws.uninstall()
            fiws.install(on_veto=mode)
        dist.barrier(group)
        _purge(_engine_prefix(engine))
        mark, amark = len(RECORDS.items), len(answers.items)
        out = {"mode": mode}
        try:
            DRIVERS[(engine, version)](root, group, other, free, out)
        except BaseException as exc:  # reported, never hidden
            out["crashed"] = _error(exc)
            out["traceback"] = traceback.format_exc()[-3000:]
        records = RECORDS.items[mark:]
        text = "\n".join(r["msg"] for r in records if r["logger"] == "flashinfer_safe_workspace")
        out["decisions"] = parse_decision_lines(text)
        out["answers"] = answers.items[amark:]
        out["shim_warnings"] = [r["msg"] for r in records if r["level"] == "WARNING"
                                and r["logger"] == "flashinfer_safe_workspace"]
        out["records"] = [r for r in records if r["level"] in ("WARNING", "ERROR", "INFO")
                          and r["logger"] != "flashinfer_safe_workspace"]
        out["standins"] = sorted(n for n, m in sys.modules.items()
                                 if isinstance(getattr(m, "__dict__", {}).get("__standin__"), str))
        out["real_files"] = sorted(
            str(Path(m.__file__).relative_to(root)) for m in list(sys.modules.values())
            if getattr(m, "__file__", None) and str(m.__file__).startswith(str(root)))
        result["modes"][mode] = out
        dist.barrier(group)
    print(json.dumps(result, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    main(sys.argv[1:])
