"""One rank of an engine-compatibility run (started by the tests, one process per rank).

    python engine_rank.py ENGINE VERSION ROOT RANK WORLD PORT SCENARIO FREE_MB

ROOT holds the engine's real files, fetched from its wheel (``_wheels.fetch``); they
are imported under their real module names (their parent packages are namespace
packages: no ``__init__.py`` is fetched, so nothing else of the engine loads). The
few modules they import that need the rest of the engine (or a GPU) are replaced by
the stand-ins below, each with the reason. The shim is activated the production way
(``FLASHINFER_SAFE_WORKSPACE=1`` in the environment, so the installed ``.pth`` runs),
FlashInfer is the installed one, the vote runs over real gloo groups, and the GPU is
a ``SimulatedDevice`` with FREE_MB free MiB. Prints one JSON line.
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

from _engines import VLLM_PASS, literal  # noqa: E402

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


def vllm_standins(root: Path) -> None:
    _module("vllm.logger", "vLLM's logger module configures logging through vllm.config "
            "(pydantic, transformers); the stand-in keeps its *_once API",
            init_logger=_OnceLogger)
    platform = types.SimpleNamespace(
        is_cuda=lambda: True, is_cuda_alike=lambda: True,
        get_device_capability=lambda device_id=0: _Capability((9, 0)),
        has_device_capability=lambda cap, device_id=0: 90 >= (
            cap if isinstance(cap, int) else cap[0] * 10 + cap[1]))
    _module("vllm.platforms", "no GPU on CI: the platform of a single-node H200 (SM 9.0)",
            current_platform=platform)
    table = literal(root / VLLM_PASS, "FI_ALLREDUCE_FUSION_MAX_SIZE_MB")

    class PassConfig:
        @staticmethod
        def default_fi_allreduce_fusion_max_size_mb():
            return table.get(90, {})

    _module("vllm.config.compilation", "the real module is vLLM's pydantic config; the "
            "stand-in serves the one method used, from the real table of the fetched "
            "fusion pass (SM 9.0 row)", PassConfig=PassConfig)
    aru = root / "vllm/distributed/device_communicators/all_reduce_utils.py"
    if aru.exists():
        _module("vllm.distributed.device_communicators.all_reduce_utils",
                "the real module loads CUDA runtime wrappers; only its constant is used, "
                "read from the fetched file", FI_MNNVL_ALLREDUCE_MAX_SIZE_MB=literal(
                    aru, "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB"))
    _module("vllm.distributed.parallel_state", "the real module is vLLM's whole distributed "
            "runtime; every rank of this test runs on one host, which is what the real "
            "_node_count computes", _node_count=lambda group: 1)


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
    from flashinfer_safe_workspace import _patch

    return _patch.is_ours(fn)


# --------------------------------------------------------------------------- main


def main(argv):
    engine, version, root, rank, world, port, scenario, free_mb = argv
    root, rank, world, free = Path(root), int(rank), int(world), int(free_mb) * MiB
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    logging.getLogger().addHandler(RECORDS)
    import torch.distributed as dist

    from flashinfer_safe_workspace import _decide, _probe

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    group = dist.new_group(list(range(world)), backend="gloo")  # the engine's TP cpu_group
    other = dist.new_group(list(range(world)), backend="gloo")  # another group, same ranks
    _probe.set_prober(_probe.SimulatedDevice(free, device=rank))
    sys.path.insert(0, str(root))
    out = {"rank": rank, "pid": os.getpid(), "engine": engine, "version": version,
           "scenario": scenario}
    try:
        if engine == "vllm":
            vllm_standins(root)
            {"0.33.0": drive_vllm_033, "0.18.0": drive_vllm_018}[version](root, group, other, out)
        else:
            coordinator = _Coordinator(other, group)  # device_group (NCCL in SGLang), cpu_group
            if version == "0.5.23":
                driver = simulate_gpu_for_engine(free)
                sglang_0523_standins(root, coordinator, driver, "trtllm")
                drive_sglang_0523(root, group, other, out)
            else:
                sglang_0510_standins(root, coordinator)
                drive_sglang_0510(root, group, other, out)
    except BaseException as exc:  # reported, never hidden
        out["crashed"] = _error(exc)
        out["traceback"] = traceback.format_exc()[-3000:]
    from flashinfer_safe_workspace.cli.logline import parse_decision_lines

    text = "\n".join(r["msg"] for r in RECORDS.items if r["logger"] == "flashinfer_safe_workspace")
    out["decisions"] = parse_decision_lines(text)
    out["report"] = {k: v for k, v in _decide.last_report.items() if k != "note"}
    out["records"] = [r for r in RECORDS.items if r["level"] in ("WARNING", "ERROR", "INFO")
                      and r["logger"] != "flashinfer_safe_workspace"]
    out["standins"] = sorted(n for n, m in sys.modules.items()
                             if isinstance(getattr(m, "__dict__", {}).get("__standin__"), str))
    out["real_files"] = sorted(str(Path(m.__file__).relative_to(root))
                               for m in list(sys.modules.values())
                               if getattr(m, "__file__", None) and str(m.__file__).startswith(str(root)))
    print(json.dumps(out, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    main(sys.argv[1:])
