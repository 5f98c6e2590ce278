"""CPU stand-ins for the GPU check (``GPUCHECK_FAKE=1``): tests the harness, not FlashInfer.

What is faked, per rank process:
- the device: a ``FakeGPU`` byte counter (140 GiB, 512 MiB taken by the "context");
- the world process group runs on gloo instead of NCCL; "NCCL" costs
  ``NCCL_INIT_BYTES`` at its first collective, and a rank that lacks them raises
  there while its peer blocks in the collective (FlashInfer 0.7.4's cold-NCCL hang);
- the body of FlashInfer's legacy creation function (the real unified function, the
  real ``TRTLLMAllReduceFusionWorkspace`` and every binding of the legacy function,
  wrapped by the shim or not, stay FlashInfer's): it follows 0.7.4's allocation
  sequence (B4: FABRIC attempt, released, then POSIX; a vote after each attempt), or
  with ``GPUCHECK_FAKE_ALLOCATOR=B3`` 0.7.2.post1's (POSIX, no vote, then the fd exchange)
  through ``flashinfer.comm.mnnvl.cuda`` and ``flashinfer.comm.trtllm_ar.cudart``,
  which are replaced by fakes (so case e's recorder wraps them as it wraps the real ones);
- ``allreduce_fusion`` (gloo all-reduce, then the residual + RMSNorm on the CPU);
- the shim's probe (a ``SimulatedDevice`` reading the fake free bytes).

Nothing here runs on a GPU host: the real cases never import this module.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading

MiB = 1 << 20
GiB = 1 << 30
GRAN = 2 * MiB
NCCL_INIT_BYTES = 300 * MiB
SIGNAL_PAD = 2048
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)


def _ru(value, multiple):
    return -(-int(value) // multiple) * multiple


class FakeErr(int):
    def __new__(cls, value, name):
        obj = int.__new__(cls, value)
        obj.name = name
        return obj


SUCCESS = FakeErr(0, "CUDA_SUCCESS")
OOM = FakeErr(2, "CUDA_ERROR_OUT_OF_MEMORY")
NOT_PERMITTED = FakeErr(800, "CUDA_ERROR_NOT_PERMITTED")


class FakeEnum(int):
    def __new__(cls, value, name):
        obj = int.__new__(cls, value)
        obj.name = name
        return obj


FABRIC = FakeEnum(8, "CU_MEM_HANDLE_TYPE_FABRIC")
POSIX = FakeEnum(1, "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")


class FakeProp:
    def __init__(self, handle_type):
        self.requestedHandleTypes = handle_type


class FakeGPU:
    def __init__(self, rank: int):
        self.rank = rank
        self.total = 140 * GiB
        self.used = 512 * MiB  # the CUDA context
        self.nccl_warm = False
        self.handles = {}
        self.next_id = 1
        self.lock = threading.Lock()

    def free(self) -> int:
        return self.total - self.used

    def create(self, size: int):
        with self.lock:
            if size > self.free():
                return None
            hid = self.next_id
            self.next_id += 1
            self.handles[hid] = size
            self.used += size
            return hid

    def release(self, hid: int) -> bool:
        with self.lock:
            size = self.handles.pop(int(hid), None)
            if size is None:
                return False
            self.used -= size
            return True


class FakeDriver:
    """The few driver entry points the fake FlashInfer calls (as ``mnnvl.cuda``)."""

    def __init__(self, gpu: FakeGPU):
        self.gpu = gpu

    def cuMemCreate(self, size, prop, flags):
        hid = self.gpu.create(int(size))
        return (OOM,) if hid is None else (SUCCESS, hid)

    def cuMemRelease(self, handle):
        return (SUCCESS,) if self.gpu.release(int(handle)) else (FakeErr(1, "CUDA_ERROR_INVALID_VALUE"),)

    def cuMemAlloc(self, size):
        hid = self.gpu.create(_ru(max(int(size), 1), 512))
        return (OOM,) if hid is None else (SUCCESS, hid)

    def cuMemFree(self, ptr):
        return self.cuMemRelease(ptr)

    def cuMemGetInfo(self):
        return (SUCCESS, self.gpu.free(), self.gpu.total)


class FakeCudart:
    def __init__(self, gpu: FakeGPU):
        self.gpu = gpu

    def cudaMalloc(self, size):
        hid = self.gpu.create(_ru(max(int(size), 1), 512))
        if hid is None:
            raise RuntimeError("CUDART error: out of memory")
        return hid

    def cudaMemset(self, *args):
        return None

    def cudaMemcpy(self, *args):
        return None


class FakeHog:
    def __init__(self, device):
        self.device, self.handles = device, []
        self.gran = GRAN

    @property
    def held(self):
        return sum(self.device.gpu.handles.get(h, 0) for h in self.handles)

    def fill(self, leave: int) -> int:
        gpu = self.device.gpu
        extra = gpu.free() - max(int(leave), 0)
        if extra >= GRAN:
            self.handles.append(gpu.create(extra - extra % GRAN))
        return gpu.free()

    def set(self, leave: int) -> int:
        self.release()
        return self.fill(leave)

    def release(self):
        while self.handles:
            self.device.gpu.release(self.handles.pop())


class FakeDevice:
    fake = True

    def __init__(self, rank: int):
        import torch

        self.torch = torch
        self.rank = rank
        self.gpu = FakeGPU(rank)
        self.torch_device = torch.device("cpu")
        self._hog = None
        activate(self)

    @property
    def nccl_warm(self):
        return self.gpu.nccl_warm

    @nccl_warm.setter
    def nccl_warm(self, value):
        if value and not self.gpu.nccl_warm:
            self.gpu.used += NCCL_INIT_BYTES
        self.gpu.nccl_warm = bool(value)

    def free_total(self):
        return self.gpu.free(), self.gpu.total

    def free(self):
        return self.gpu.free()

    def track_own(self):
        pass

    def own(self):
        """The fake GPU is this process's alone: what it holds is all this rank holds."""
        return {"torch_reserved": 0, "driver_held": self.gpu.used, "nvml": None}

    def torch_stats(self):
        return {"allocated": 0, "reserved": 0}

    def sync(self):
        pass

    def empty_cache(self):
        pass

    def hog(self):
        if self._hog is None:
            self._hog = FakeHog(self)
        return self._hog

    def preload_flashinfer_module(self):
        pass


# --------------------------------------------------------------------------- fake FlashInfer

_device = None


def _collective(obj):
    """FlashInfer's TorchDistBackend.allgather: NCCL's first use costs memory."""
    import torch.distributed as dist

    gpu = _device.gpu
    if not gpu.nccl_warm and os.environ.get("GPUCHECK_WORLD_BACKEND") != "gloo":
        if gpu.free() < NCCL_INIT_BYTES:
            raise RuntimeError("fake DistBackendError: NCCL error in ncclCommInitRank: "
                               "Cuda failure 2 'out of memory'")
        _device.nccl_warm = True
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# Device memory the driver takes per mapped buffer beyond the allocation (page tables):
# not in the plan, not voted on by FlashInfer. 0 by default; the harness tests set it
# to make a false pass (and the peer's hang) happen on purpose.
MAP_BYTES = int(os.environ.get("GPUCHECK_FAKE_MAP_BYTES", "0"))


class _FakeSymm:
    def __init__(self, drv, handle, ptr, mapped=None):
        self.drv, self.handle, self.ptr, self.mapped = drv, handle, ptr, mapped

    def __del__(self):
        try:
            self.drv.cuMemFree(self.ptr)
            self.drv.cuMemRelease(self.handle)
            if self.mapped is not None:
                _device.gpu.release(self.mapped)
        except Exception:
            pass


def _b4_alloc(drv, size):
    """One SymmDeviceMemory as 0.7.4 makes it on one host: the handle-type vote, a
    FABRIC attempt (its export fails without IMEX), a vote, release, then the same with
    POSIX fds; RuntimeError on every rank if a rank failed that too."""
    _collective("handle type")
    errors = []
    for handle_type in (FABRIC, POSIX):
        err, handle = None, None
        result = drv.cuMemCreate(size, FakeProp(handle_type), 0)
        if int(result[0]) != 0:
            err = f"creating or exporting the allocation failed: {result[0].name}"
        else:
            handle = result[1]
            if handle_type == FABRIC:
                err = "creating or exporting the allocation failed: CUDA_ERROR_NOT_PERMITTED"
        errors = _collective(err)
        if not any(errors):
            return handle
        if handle is not None:
            drv.cuMemRelease(handle)
    failed = "\n".join(f"  rank {r}: {e}" for r, e in enumerate(errors) if e)
    raise RuntimeError("[MNNVL] allocating memory shared through POSIX file descriptor "
                       f"handles failed:\n{failed}")


# Which of FlashInfer's symmetric-memory procedures the fake follows: B4 (0.7.4, the
# default: the handle type and every cuMemCreate are voted) or B3 (0.6.16-0.7.2.post1:
# no vote; the hang case w sets GPUCHECK_FAKE_ALLOCATOR=B3).
ALLOCATOR = os.environ.get("GPUCHECK_FAKE_ALLOCATOR", "B4")


def fake_exchange_fds(handle):
    """B3's POSIX fd exchange: its first step is an all-gather of socket paths, which
    waits for every rank (the hang case's peer blocks here)."""
    return _collective(("fd", int(handle)))


def _b3_alloc(drv, size):
    """One SymmDeviceMemory as 0.6.16-0.7.2.post1 make it on one host: POSIX fds chosen
    locally, cuMemCreate with no vote (an OOM raises on this rank alone, as
    checkCudaErrors does), then the fd exchange."""
    result = drv.cuMemCreate(size, FakeProp(POSIX), 0)
    if int(result[0]) != 0:
        raise RuntimeError(f"CUDA error: {result[0].name}")
    fake_exchange_fds(result[1])
    return result[1]


def fake_legacy(tp_rank, tp_size, max_token_num, hidden_dim, use_fp32_lamport=False,
                group=None, create_metadata=False, comm_backend=None, use_symm_dev_mem=False):
    """0.7.4's trtllm_create_ipc_workspace_for_all_reduce_fusion, B4 path only."""
    from flashinfer.comm import mnnvl, trtllm_ar

    if not create_metadata:
        raise ValueError("the fake supports create_metadata=True only")
    if not use_symm_dev_mem:
        return _fake_legacy_torch_symm(tp_rank, tp_size, max_token_num, hidden_dim,
                                       use_fp32_lamport)
    drv, cudart = mnnvl.cuda, trtllm_ar.cudart
    wide = 4 if use_fp32_lamport else 2
    buffer_size = tp_size * max_token_num * hidden_dim * wide
    flag_size = tp_size * 256 * 4
    lamport_comm = min(tp_size * max_token_num * hidden_dim * wide, MAX_COMM_SIZE)
    refs, ipc = [], []
    for size in (buffer_size, flag_size, 3 * lamport_comm):
        alloc = _ru(_ru(size, 16) + SIGNAL_PAD, GRAN)
        handle = _b3_alloc(drv, alloc) if ALLOCATOR == "B3" else _b4_alloc(drv, alloc)
        mapped = None
        if MAP_BYTES:  # cuMemMap/cuMemSetAccess after the vote: a failure here is one-sided
            mapped = _device.gpu.create(MAP_BYTES)
            if mapped is None:
                drv.cuMemRelease(handle)
                raise RuntimeError("CUDA error code=2(CUDA_ERROR_OUT_OF_MEMORY)")
        result = drv.cuMemAlloc(8 * tp_size)
        if int(result[0]) != 0:
            drv.cuMemRelease(handle)
            raise RuntimeError(f"CUDA error code={int(result[0])}({result[0].name})")
        refs.append(_FakeSymm(drv, handle, result[1], mapped))
        ipc.append([handle * 1000 + r for r in range(tp_size)])
    trtllm_ar._symm_workspace_refs[id(ipc)] = refs
    cudart.cudaMalloc(20)
    _collective("barrier")
    metadata = {"tp_rank": tp_rank, "tp_size": tp_size, "max_token_num": max_token_num,
                "hidden_dim": hidden_dim, "use_fp32_lamport": use_fp32_lamport,
                "buffer_size": buffer_size, "flag_size": flag_size,
                "lamport_comm_size": lamport_comm, "lamport_buffer_size": 3 * lamport_comm,
                "control_flag_ptr": 0}
    return ipc, None, list(refs), metadata


def torch_signal_pad() -> int:
    """The installed torch's symmetric-memory signal pad (what torch really adds)."""
    try:
        from torch.distributed import _symmetric_memory

        return int(_symmetric_memory.get_signal_pad_size())
    except Exception:  # noqa: BLE001 - a torch without the query
        return SIGNAL_PAD


class _FakeTorchSymm:
    def __init__(self, hid):
        self.hid = hid

    def __del__(self):
        try:
            _device.gpu.release(self.hid)
        except Exception:
            pass


def fake_alloc_symm_buffer_bytes(size_bytes, world_size, dtype, device, group_name):
    """FlashInfer's ``_alloc_symm_buffer_bytes`` (torch symmetric memory): one buffer of
    RU(size + torch's signal pad, granularity), then the rendezvous (a collective)."""
    hid = _device.gpu.create(_ru(int(size_bytes) + torch_signal_pad(), GRAN))
    if hid is None:
        raise RuntimeError("CUDA out of memory (fake torch symmetric memory)")
    handle = _FakeTorchSymm(hid)
    _collective("rendezvous")
    return [hid * 1000 + r for r in range(world_size)], None, handle


def _fake_legacy_torch_symm(tp_rank, tp_size, max_token_num, hidden_dim, use_fp32_lamport):
    """0.7.4's legacy default path (allocator C): three torch symmetric-memory buffers,
    each RU(RU(size, 16) + torch's signal pad, granularity), no FABRIC attempt."""
    from flashinfer.comm import trtllm_ar

    wide = 4 if use_fp32_lamport else 2
    buffer_size = tp_size * max_token_num * hidden_dim * wide
    flag_size = tp_size * 256 * 4
    lamport_comm = min(tp_size * max_token_num * hidden_dim * wide, MAX_COMM_SIZE)
    refs, ipc = [], []
    for size in (buffer_size, flag_size, 3 * lamport_comm):
        ptrs, tensor, handle = trtllm_ar._alloc_symm_buffer_bytes(_ru(size, 16), tp_size, None,
                                                                  None, "0")
        refs.append((tensor, handle))
        ipc.append(ptrs)
    trtllm_ar._symm_workspace_refs[id(ipc)] = refs
    trtllm_ar.cudart.cudaMalloc(20)
    _collective("barrier")
    metadata = {"tp_rank": tp_rank, "tp_size": tp_size, "max_token_num": max_token_num,
                "hidden_dim": hidden_dim, "use_fp32_lamport": use_fp32_lamport,
                "buffer_size": buffer_size, "flag_size": flag_size,
                "lamport_comm_size": lamport_comm, "lamport_buffer_size": 3 * lamport_comm}
    return ipc, None, metadata


def _legacy_body(tp_rank, tp_size, max_token_num, hidden_dim, use_fp32_lamport=False,
                 group=None, create_metadata=False, comm_backend=None, use_symm_dev_mem=False):
    """Becomes the code of FlashInfer's own legacy function (see ``activate``): it runs
    with that function's globals, hence the import."""
    import gpucheck_fake

    return gpucheck_fake.fake_legacy(tp_rank, tp_size, max_token_num, hidden_dim,
                                     use_fp32_lamport, group, create_metadata, comm_backend,
                                     use_symm_dev_mem)


def fake_allreduce_fusion(input, workspace, pattern, launch_with_pdl=False,
                          trigger_completion_at_end=True, output=None, residual_out=None,
                          norm_out=None, quant_out=None, scale_out=None, residual_in=None,
                          rms_gamma=None, rms_eps=1e-6, **kwargs):
    import torch
    import torch.distributed as dist

    total = input.float().clone()
    dist.all_reduce(total)
    if output is None:
        output = torch.empty_like(input)
    output.copy_(total.to(input.dtype))
    if pattern == 0:
        return output
    pre = (total.to(input.dtype).float() + residual_in.float()).to(input.dtype)
    residual_out.copy_(pre)
    p = pre.float()
    norm = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + rms_eps) * rms_gamma.float()
    norm_out.copy_(norm.to(input.dtype))
    return norm_out


def activate(device) -> None:
    """Swap FlashInfer's device-facing pieces for the fakes (once per process)."""
    global _device
    _device = device
    import flashinfer.comm as comm
    from flashinfer.comm import allreduce, mnnvl, trtllm_ar

    mnnvl.cuda = FakeDriver(device.gpu)
    trtllm_ar.cudart = FakeCudart(device.gpu)
    trtllm_ar.trtllm_lamport_initialize = lambda *a, **k: None
    trtllm_ar._alloc_symm_buffer_bytes = fake_alloc_symm_buffer_bytes
    # FlashInfer's own legacy function object gets the fake's code, so that every binding
    # (flashinfer.comm, .allreduce, .trtllm_ar; wrapped by the shim or not) and the real
    # TRTLLMAllReduceFusionWorkspace -> legacy call path run unchanged around it.
    inner = inspect.unwrap(trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)
    if inner.__code__ is not _legacy_body.__code__:
        assert inner.__code__.co_varnames[:9] == _legacy_body.__code__.co_varnames[:9], \
            "FlashInfer's legacy signature changed"
        inner.__code__ = _legacy_body.__code__
    for module in (comm, allreduce):
        module.allreduce_fusion = fake_allreduce_fusion
    if "flashinfer_safe_workspace" in sys.modules:
        install_prober()


def install_prober() -> None:
    from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    gpu = _device.gpu

    class FakeProber(SimulatedDevice):
        name = "fake-gpu"

        @property
        def free_bytes(self):
            return gpu.free()

        @free_bytes.setter
        def free_bytes(self, value):
            pass

        def facts(self, device, confidential_compute, world_size):
            import dataclasses

            facts = super().facts(device, confidential_compute, world_size)
            return dataclasses.replace(facts, fabric_supported=True, device_count=2,
                                       current_device=gpu.rank)

    _probe.set_prober(FakeProber(gpu.free(), total_bytes=gpu.total, device=gpu.rank))


if os.environ.get("GPUCHECK_FAKE") != "1":  # a guard against importing this by mistake
    raise ImportError("gpucheck_fake is for GPUCHECK_FAKE=1 runs only")
