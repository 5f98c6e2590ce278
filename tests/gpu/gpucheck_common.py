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


class RealDevice:
    """Rank r on cuda:r. Only cuMemGetInfo-style queries and the hog touch the driver."""

    fake = False

    def __init__(self, rank: int):
        import torch

        self.torch = torch
        self.rank = rank
        torch.cuda.set_device(rank)
        torch.cuda.init()
        self.torch_device = torch.device("cuda", rank)
        self._hog = None

    def free_total(self) -> tuple:
        free, total = self.torch.cuda.mem_get_info(self.rank)
        return int(free), int(total)

    def free(self) -> int:
        return self.free_total()[0]

    def torch_stats(self) -> dict:
        t = self.torch.cuda
        return {"allocated": int(t.memory_allocated(self.rank)),
                "reserved": int(t.memory_reserved(self.rank))}

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.rank)

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
        prop.location.id = device.rank
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
        backend = "gloo" if device.fake else "nccl"
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


def legacy_kwargs(shape: dict, rank: int, world_size: int) -> dict:
    return dict(tp_rank=rank, tp_size=world_size, max_token_num=shape["T"],
                hidden_dim=shape["H"], use_fp32_lamport=shape["dtype"] == "float32",
                create_metadata=True, use_symm_dev_mem=True)


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
