"""Rank-side helpers shared by every GPU-check rank script.

Never imports ``flashinfer_safe_workspace``: the ``.pth`` activation case (h) runs a
rank script that must not import it itself. Imports torch and FlashInfer lazily.

Each rank writes one JSON object per line to stdout, prefixed with ``@@GPUCHECK ``;
the parent (``gpucheck_cases``) reads them live. ``call_start``/``call_end`` bracket
every call that could block, so that the parent can kill a rank blocked longer than
the case's bound and report it as a hang.

``GPUCHECK_FAKE=1`` (CPU only, for testing the harness): the device, the PyTorch
process group backend and FlashInfer's creation are replaced by ``gpucheck_fake``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

MiB = 1 << 20
PREFIX = "@@GPUCHECK "
FAKE = os.environ.get("GPUCHECK_FAKE") == "1"
# One-GPU profile: every rank on cuda:0 and a gloo WORLD (NCCL refuses two ranks on one GPU).
SHARED_DEVICE = os.environ.get("GPUCHECK_SHARED_DEVICE") == "1"
WORLD_BACKEND = os.environ.get("GPUCHECK_WORLD_BACKEND") or ""

_rank = -1


# --------------------------------------------------------------------------- events


def emit(ev: str, **fields) -> None:
    record = {"ev": ev, "rank": _rank, "t": time.time()}
    record.update(fields)
    sys.stdout.write(PREFIX + json.dumps(record, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(obj):
    try:
        return int(obj)
    except Exception:
        return repr(obj)


def exc_info(exc: BaseException) -> dict:
    kind = type(exc)
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "msg": str(exc)[:3000],
            "tb": "".join(traceback.format_exception(kind, exc, exc.__traceback__))[-4000:]}


class Call:
    """``with Call("create") as c:`` emits call_start/call_end with the elapsed time,
    the outcome and any exception (which it swallows; see ``c.error``)."""

    def __init__(self, label: str, **fields):
        self.label, self.fields = label, fields
        self.error = None
        self.result_note = ""
        self.seconds = 0.0

    def __enter__(self):
        emit("call_start", label=self.label, **self.fields)
        self.wall_start = time.time()
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb):
        self.seconds = time.perf_counter() - self.start
        extra = {}
        if exc is not None:
            self.error = exc_info(exc)
            extra["error"] = self.error
        emit("call_end", label=self.label, seconds=self.seconds, wall_start=self.wall_start,
             note=self.result_note, **extra)
        return exc is not None and isinstance(exc, Exception)


# --------------------------------------------------------------------------- the decision line

DECISION_MARK = "fiws decision "
_INT_FIELDS = ("rank", "pid", "plan_bytes", "free_bytes", "headroom_bytes")


def parse_decision(text: str):
    """The ``key=value`` pairs of a shim decision line, or None if ``text`` is not one.

    Tolerant by design: fields may be added, dropped or reordered between releases of
    the shim (``audit=``, ``headroom=``, ``answer=`` and ``caller=`` arrived later);
    tokens without ``=`` are ignored; integers and ``elapsed_ms`` are converted."""
    at = text.find(DECISION_MARK)
    if at < 0:
        return None
    out = {}
    for token in text[at + len(DECISION_MARK):].split():
        key, sep, value = token.partition("=")
        if not sep or not key:
            continue
        if key in _INT_FIELDS:
            try:
                value = int(value)
            except ValueError:
                pass
        elif key.endswith("_ms"):
            try:
                value = float(value)
            except ValueError:
                pass
        out[key] = value
    return out


class DecisionLog:
    """Keeps every record of the ``flashinfer_safe_workspace`` logger in this process
    (without importing the package: a logger is looked up by name), so that a rank can
    report the decision lines and warnings of each call it makes."""

    def __init__(self):
        import logging

        self.lines: list = []  # (levelname, message)
        log = self

        class _Handler(logging.Handler):
            def emit(self, record):
                try:
                    log.lines.append((record.levelname, record.getMessage()))
                except Exception:  # noqa: BLE001 - never disturb the host's logging
                    pass

        logger = logging.getLogger("flashinfer_safe_workspace")
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(_Handler(level=logging.DEBUG))

    def mark(self) -> int:
        return len(self.lines)

    def since(self, mark: int) -> dict:
        """The decision lines (parsed) and warnings logged after ``mark``."""
        new = self.lines[mark:]
        decisions = []
        for _, m in new:
            d = parse_decision(m)
            if d is not None:
                decisions.append(d)
            elif " audit=" in m and decisions:  # an audit verdict logged on a line of its own
                extra = parse_decision(DECISION_MARK + m[m.find(" audit=") + 1:]) or {}
                if decisions[-1].get("audit") in (None, "-") and "audit" in extra:
                    decisions[-1]["audit"] = extra["audit"]
        return {"decisions": decisions,
                "warnings": [m[:2000] for lvl, m in new if lvl in ("WARNING", "ERROR")]}

    def last_decision(self, mark: int = 0):
        found = self.since(mark)["decisions"]
        return found[-1] if found else None


_decision_log = None


def decision_log() -> DecisionLog:
    global _decision_log
    if _decision_log is None:
        _decision_log = DecisionLog()
    return _decision_log


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--params", default="{}")
    args = p.parse_args(argv)
    args.params = json.loads(args.params)
    global _rank
    _rank = args.rank
    return args


# --------------------------------------------------------------------------- device


def device_index(rank: int) -> int:
    """cuda:r for rank r; cuda:0 for every rank in the one-GPU profile."""
    return 0 if SHARED_DEVICE else rank


# ----------------------------------------------------------------- what this rank holds
#
# cuMemGetInfo (free memory) is the device's: on a device two ranks share (the one-GPU
# profile) it moves with the peer's allocations, and a call that allocated nothing was
# charged the peer's 2.9 GB at 7c21911 (case p, 42 of 43). What one rank holds is measured
# per process instead: torch's reserved bytes (its caching allocator), the bytes this
# process holds through the cuda-python driver module (DriverLedger: the shim's probe,
# FlashInfer's mnnvl allocations, the hog), and NVML's per-process used memory where NVML
# lists this process (not in every container: its pids are the host's).


def _handle_key(kind: str, handle):
    try:
        return kind, int(handle)
    except Exception:  # noqa: BLE001 - an opaque handle: the object itself
        return kind, id(handle)


class DriverLedger:
    """Bytes this process holds through the cuda-python driver module(s): wraps
    cuMemCreate/cuMemRelease and cuMemAlloc/cuMemFree on the module objects, so every caller
    that looks them up there at call time (the shim's probe, FlashInfer, the hog) is
    counted. ``held`` is what was created or allocated and not yet released or freed."""

    def __init__(self):
        self.live: dict = {}
        self.modules: list = []

    @property
    def held(self) -> int:
        return sum(self.live.values())

    def install(self, module) -> None:
        if any(m is module for m in self.modules):
            return  # one module under two names: wrap it once
        self.modules.append(module)
        for name, wrap in (("cuMemCreate", self._create), ("cuMemRelease", self._release),
                           ("cuMemAlloc", self._alloc), ("cuMemFree", self._free)):
            real = getattr(module, name, None)
            if real is not None:
                setattr(module, name, wrap(real))

    @staticmethod
    def _ok(result) -> bool:
        return isinstance(result, tuple) and bool(result) and int(result[0]) == 0

    def _create(self, real):
        def cuMemCreate(size, prop, flags):
            result = real(size, prop, flags)
            if self._ok(result) and len(result) > 1:
                self.live[_handle_key("mem", result[1])] = int(size)
            return result
        return cuMemCreate

    def _release(self, real):
        def cuMemRelease(handle):
            result = real(handle)
            if self._ok(result):
                self.live.pop(_handle_key("mem", handle), None)
            return result
        return cuMemRelease

    def _alloc(self, real):
        def cuMemAlloc(size):
            result = real(size)
            if self._ok(result) and len(result) > 1:
                self.live[_handle_key("ptr", result[1])] = int(size)
            return result
        return cuMemAlloc

    def _free(self, real):
        def cuMemFree(ptr):
            result = real(ptr)
            if self._ok(result):
                self.live.pop(_handle_key("ptr", ptr), None)
            return result
        return cuMemFree


def driver_modules() -> list:
    """The cuda-python driver modules importable here (13.x ``cuda.bindings.driver``,
    12.x ``cuda.cuda``)."""
    import importlib
    import warnings

    found = []
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found.append(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - not this cuda-python
            pass
    return found


_nvml = None


def nvml_process_bytes(pid: int, nv=None):
    """NVML's used memory of process ``pid`` over every device, or None: no NVML, NVML
    does not list ``pid`` (a container's own pids), or it gives no value."""
    global _nvml
    try:
        if nv is None:
            if _nvml is None:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            nv = _nvml
        total, listed = 0, False
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                if int(proc.pid) != int(pid):
                    continue
                if proc.usedGpuMemory is None:
                    return None
                total, listed = total + int(proc.usedGpuMemory), True
        return total if listed else None
    except Exception:  # noqa: BLE001 - a measure we may not have
        return None


class RealDevice:
    """Rank r on cuda:r (cuda:0 when shared). Only cuMemGetInfo-style queries and the hog
    touch the driver."""

    fake = False

    def __init__(self, rank: int):
        import torch

        self.torch = torch
        self.rank = rank
        self.index = device_index(rank)
        self.shared = SHARED_DEVICE
        torch.cuda.set_device(self.index)
        torch.cuda.init()
        self.torch_device = torch.device("cuda", self.index)
        self._hog = None
        self.ledger = None

    def track_own(self) -> None:
        """Count this process's driver allocations from now on (``own``); call before the
        first allocation that a measure brackets."""
        if self.ledger is None:
            self.ledger = DriverLedger()
            for module in driver_modules():
                self.ledger.install(module)

    def own(self) -> dict:
        """What this process holds, by per-process measures (never the device's free
        memory): torch's reserved bytes, the driver ledger's (None before track_own), and
        NVML's per-process used memory (None where NVML does not list this process)."""
        return {"torch_reserved": int(self.torch.cuda.memory_reserved(self.index)),
                "driver_held": None if self.ledger is None else self.ledger.held,
                "nvml": nvml_process_bytes(os.getpid())}

    def free_total(self) -> tuple:
        free, total = self.torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def free(self) -> int:
        return self.free_total()[0]

    def torch_stats(self) -> dict:
        t = self.torch.cuda
        return {"allocated": int(t.memory_allocated(self.index)),
                "reserved": int(t.memory_reserved(self.index))}

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.index)

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def hog(self):
        if self._hog is None:
            self._hog = Hog(self)
        return self._hog

    def preload_flashinfer_module(self) -> None:
        """Load FlashInfer's trtllm_comm module and its Lamport-init kernel, so that
        loading code onto the GPU does not happen inside a measured creation."""
        torch = self.torch
        from flashinfer.comm import trtllm_ar

        import ctypes

        buf = torch.empty(4096, dtype=torch.float16, device=self.torch_device)
        trtllm_ar.trtllm_lamport_initialize(buf.data_ptr(), buf.numel(), torch.float16)
        # FlashInfer's ctypes libcudart calls made during creation (memset, memcpy)
        trtllm_ar.cudart.cudaMemset(ctypes.c_void_p(buf.data_ptr()), 0, 64)
        data = (4096).to_bytes(4, byteorder="little")
        trtllm_ar.cudart.cudaMemcpy(ctypes.c_void_p(buf.data_ptr() + 12),
                                    ctypes.cast(data, ctypes.c_void_p), 4)
        self.sync()
        del buf


class Hog:
    """Fills this rank's GPU with cuMemCreate (FlashInfer's prop: PINNED, this device,
    POSIX fd handles, gpuDirectRDMACapable) so that about ``leave`` bytes stay free.

    The free memory left lies in [leave, leave + 2 MiB): the allocation granularity is
    2 MiB. ``fill`` measures and returns what was actually left."""

    CHUNK_MAX = 8 << 30

    def __init__(self, device: RealDevice, drv=None):
        if drv is None:
            from cuda.bindings import driver as drv

        self.drv, self.device = drv, device
        self.handles = []
        self._check(drv.cuInit(0))
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = drv.CUmemLocation()
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = getattr(device, "index", device.rank)
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.allocFlags.gpuDirectRDMACapable = 1
        self.prop = prop
        self.gran = int(self._check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))

    @staticmethod
    def _check(result):
        err = result[0]
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {getattr(err, 'name', err)}")
        return result[1] if len(result) == 2 else (None if len(result) == 1 else result[1:])

    @property
    def held(self) -> int:
        return sum(size for _, size in self.handles)

    def fill(self, leave: int) -> int:
        leave = max(int(leave), 0)
        cap = self.CHUNK_MAX
        for _ in range(400):
            free = self.device.free()
            extra = free - leave
            if extra < self.gran:
                break
            size = min(extra - extra % self.gran, cap)
            result = self.drv.cuMemCreate(size, self.prop, 0)
            if int(result[0]) != 0:
                if size <= self.gran:
                    break  # what is reported free cannot be had in granules
                cap = max(self.gran, (size // 2) - (size // 2) % self.gran)
                continue
            self.handles.append((result[1], size))
        return self.device.free()

    def set(self, leave: int) -> int:
        """Release everything, then fill to ``leave``."""
        self.release()
        return self.fill(leave)

    def release(self) -> None:
        while self.handles:
            handle, _ = self.handles.pop()
            self._check(self.drv.cuMemRelease(handle))


def make_device(rank: int):
    if FAKE:
        import gpucheck_fake

        return gpucheck_fake.FakeDevice(rank)
    return RealDevice(rank)


# --------------------------------------------------------------------------- process groups


class Group:
    """The world process group (NCCL; gloo in fake mode) and a gloo group of the
    harness's own for barriers (never the shim's vote group)."""

    def __init__(self, args, device, pg_timeout_s: float = 300.0):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = args.rank, args.world_size
        backend = "gloo" if device.fake else (WORLD_BACKEND or "nccl")
        self.backend = backend
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        self.harness = dist.new_group(backend="gloo",
                                      timeout=datetime.timedelta(seconds=120))
        self.device = device
        self.nccl_warm = False

    def barrier(self) -> None:
        self.dist.barrier(group=self.harness)

    def warm_nccl(self) -> None:
        """Initialise the world group's NCCL communicator and its connections for the
        collectives FlashInfer uses (all_gather_object, broadcast_object_list, barrier),
        keeping the caching allocator's small blocks cached afterwards."""
        dist, torch = self.dist, sys.modules["torch"]
        if self.backend != "nccl" and not self.device.fake:
            emit("note", what="warm_nccl skipped: the world group is " + self.backend)
            return
        x = torch.ones(1024, device=self.device.torch_device)
        dist.all_reduce(x)
        out = [None] * self.size
        dist.all_gather_object(out, ("warm", self.rank))
        obj = [("warm", self.rank)]
        dist.broadcast_object_list(obj, src=0)
        dist.barrier()
        self.device.sync()
        del x
        self.nccl_warm = True
        if self.device.fake:
            self.device.nccl_warm = True


# --------------------------------------------------------------------------- shapes / FlashInfer


def dtype_of(name: str):
    import torch

    return getattr(torch, name)


def unified_kwargs(shape: dict, rank: int, world_size: int) -> dict:
    return dict(backend="trtllm", world_size=world_size, rank=rank,
                max_token_num=shape["T"], hidden_dim=shape["H"], dtype=dtype_of(shape["dtype"]))


def legacy_kwargs(shape: dict, rank: int, world_size: int, symm_dev_mem: bool = True) -> dict:
    """The legacy function's arguments; ``symm_dev_mem=False`` is its default path, which
    in 0.6.16-0.7.4 allocates through torch symmetric memory (allocator C)."""
    return dict(tp_rank=rank, tp_size=world_size, max_token_num=shape["T"],
                hidden_dim=shape["H"], use_fp32_lamport=shape["dtype"] == "float32",
                create_metadata=True, use_symm_dev_mem=symm_dev_mem)


def unwrap(fn):
    """FlashInfer's own function behind the shim's wrapt proxy (if any)."""
    while getattr(fn, "_self_flashinfer_safe_workspace", False):
        fn = fn.__wrapped__
    return fn


def release_workspace(ws, stages=None):
    """Free a FlashInfer 0.7.4 trtllm workspace for real, stage by stage.

    ``workspace.destroy()`` alone frees nothing in 0.7.4: ``trtllm_ar._symm_workspace_refs``
    (keyed by id(ipc_handles)) and ``ws._internal_workspace`` still hold the
    SymmDeviceMemory objects. ``stages`` (callable(name)) is called after each step.
    Accepts a unified workspace object or the legacy tuple. The caller must drop its own
    reference too, then call ``collect()``."""
    from flashinfer.comm import trtllm_ar

    note = stages or (lambda name: None)
    if isinstance(ws, tuple):
        ipc = ws[0]
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc)
        note("legacy_refs_dropped")
        return
    internal = ws.__dict__.get("_internal_workspace")
    ipc = internal[0] if isinstance(internal, tuple) and internal else None
    ws.destroy()
    collect()
    note("destroy")
    if ipc is not None:
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc)
    ws.__dict__["_internal_workspace"] = None
    del internal, ipc
    collect()
    note("refs_dropped")


def collect() -> None:
    gc.collect()


def settle() -> None:
    """Collect, then freeze what exists (modules, torch, FlashInfer): later collections
    scan only new objects (milliseconds instead of ~0.5 s with torch loaded). Call only
    while no workspace is alive: frozen objects are never collected by the gc."""
    gc.collect()
    gc.freeze()


def finish(group=None, linger: bool = False, barrier: bool = True) -> None:
    """Report done and leave without process-group teardown (a peer may be stuck)."""
    if group is not None and barrier:
        try:
            group.barrier()
        except Exception as exc:  # noqa: BLE001
            emit("warning", where="final barrier", error=exc_info(exc))
    emit("done")
    if linger:  # keep this rank alive (a peer may be blocked on it); the parent kills it
        time.sleep(3600)
    os._exit(0)


def run_main(case_functions: dict, argv=None) -> None:
    """Parse the arguments, run the case, turn any exception into an error event."""
    args = parse_args(argv)
    if FAKE:
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
    emit("start", case=args.case, pid=os.getpid(), python=sys.version.split()[0],
         fake=FAKE, params=args.params)
    fn = case_functions.get(args.case)
    if fn is None:
        emit("error", where="dispatch", error={"type": "KeyError", "msg": f"no case {args.case}"})
        finish(barrier=False)
    try:
        fn(args)
    except BaseException as exc:  # noqa: BLE001 - report, then leave
        emit("error", where="case", error=exc_info(exc))
        finish(barrier=False, linger=bool(args.params.get("linger")))
