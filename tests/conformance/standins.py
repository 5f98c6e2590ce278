"""Recording stand-ins for the CUDA calls FlashInfer's workspace creation makes.

The conformance test runs FlashInfer's *real* creation code (whatever flashinfer is
importable: the installed 0.7.4, or another release put first on PYTHONPATH by
scripts/conformance-matrix) on a CPU-only machine. Everything that would touch a GPU
is replaced at the narrowest point we could find, and the stand-ins that allocate
record what FlashInfer asks for: (api, bytes, handle type, device, held).

What is replaced, and why there:

* the CUDA *driver* module object that FlashInfer binds as ``cuda`` (mnnvl.py) or
  ``driver`` (cuda_utils.py): cuMemCreate records (size, prop.requestedHandleTypes,
  prop.location.id); cuMemRelease marks that record transient; granularity queries
  return the case's G / Gmc; FABRIC exports fail without an IMEX channel, like the
  H200 in §9 of the reference; cuMemAlloc records; the rest succeed with fake values.
  Types and enums (CUmemAllocationProp, CUresult, …) stay the real cuda-python ones.
* FlashInfer's ctypes ``cudart`` object (cuda_ipc.py, trtllm_ar.py): cudaMalloc records.
* ``cuda.bindings.runtime.cudaSetDevice`` (SymmDeviceMemory imports it at call time).
* ``pynvml`` as bound in flashinfer.comm.mnnvl: the NVML fabric state (B1–B3's
  FABRIC test) comes from the case.
* the POSIX-fd transports: ``IpcSocket`` (≤0.6.15) and ``exchange_fds`` /
  ``broadcast_fd`` (0.6.16+). One process stands in for every rank, so the "peers'"
  descriptors are fresh /dev/null fds (FlashInfer closes what it receives).
* torch symmetric memory (``torch.distributed._symmetric_memory.empty`` and
  ``rendezvous``): ``empty`` records the cuMemCreate that torch's CUDA allocator
  would make for the bytes FlashInfer requests — block = RU(RU(bytes, 16) + P_t, G),
  POSIX handles (our model of torch, §3-C of the reference; torch is not FlashInfer,
  so this part is modelled, not observed) — and returns a meta tensor; ``rendezvous``
  records torch's two raw_alloc(8·ws) pointer arrays.
* the Lamport init kernel (``trtllm_lamport_initialize``): it would JIT-compile CUDA.
* ``torch.tensor(..., device="cuda")``: made on the CPU and recorded as a "torch"
  allocation of numel·element_size bytes. ``torch.cuda.current_device`` /
  ``device_count`` / ``synchronize``: CPU torch has no CUDA.
* torch.distributed (``group.WORLD``, ``barrier``, ``all_gather_object``,
  ``get_rank``, ``get_world_size``, ``is_initialized``): one process plays rank r of
  a group of ws; gathers return ws copies of this rank's value.

The comm backend FlashInfer uses for its own collectives is ``FakeComm`` below,
passed as ``comm_backend=``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- import time


def _flashinfer_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _needs_libcudart() -> bool:
    """0.5.x–0.6.10 build their ctypes libcudart binding at import time."""
    root = _flashinfer_dir()
    if root is None:
        return False
    source = (root / "comm" / "cuda_ipc.py")
    return source.exists() and "\ncudart = CudaRTLibrary()" in source.read_text()


def _libcudart_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("/libcudart" in line for line in maps)


def _load_libcudart_stub() -> str:
    """Compile (once, cached by source hash) and load tests/conformance/libcudart_stub.c."""
    source = HERE / "libcudart_stub.c"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / f"fiws-libcudart-stub-{digest}"
    lib = out_dir / "libcudart.so.12"
    if not lib.exists():
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            raise RuntimeError("no C compiler to build the libcudart import stub")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"libcudart.so.12.{os.getpid()}"
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(tmp), str(source)],
                       check=True, timeout=120, capture_output=True)
        os.replace(tmp, lib)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return str(lib)


class _Anything(types.ModuleType):
    """A module whose every attribute exists (import-time stand-in for triton)."""

    __version__ = "3.0.0"  # flashinfer/triton kernels compare it at import

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _anything

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator (@triton.jit)
        return _anything

    def __getitem__(self, item):
        return _anything


_anything = _Anything("anything")


@contextlib.contextmanager
def _import_time_standins(fake_triton: bool):
    """What a CPU-only host lacks while FlashInfer's modules are imported.

    * libcudart (0.5.x–0.6.10 bind it at import);
    * torch.cuda.get_device_properties (0.6.10–0.6.17 gdn kernels read the SM count of
      device 0 at import);
    * triton, only when the import fails without it (0.6.10's flashinfer.comm imports
      its all-gather-matmul triton kernels).
    None of them is used by workspace creation; they are undone after the import.
    """
    if _needs_libcudart() and not _libcudart_loaded():
        _load_libcudart_stub()
    saved_props = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=132, major=9, minor=0, name="conformance stand-in",
        total_memory=150 * (1 << 30), L2_cache_size=50 << 20)
    stubs = {}
    if fake_triton:
        for name in ("triton", "triton.language", "triton.tools",
                     "triton.tools.tensor_descriptor"):
            stubs[name] = _Anything(name)
        sys.modules.update(stubs)
    try:
        yield
    finally:
        torch.cuda.get_device_properties = saved_props
        for name in stubs:
            sys.modules.pop(name, None)


def _import_comm() -> None:
    import flashinfer
    import flashinfer.comm
    import flashinfer.comm.mnnvl  # noqa: F401
    import flashinfer.comm.trtllm_ar  # noqa: F401
    import flashinfer.comm.trtllm_mnnvl_ar  # noqa: F401


def import_flashinfer():
    """Import flashinfer and the comm modules the workspace creation uses."""
    try:
        with _import_time_standins(fake_triton=False):
            _import_comm()
    except ModuleNotFoundError as exc:
        if exc.name != "triton" and not str(exc.name).startswith("triton."):
            raise
        for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[name]
        with _import_time_standins(fake_triton=True):
            _import_comm()
    return sys.modules["flashinfer"]


# --------------------------------------------------------------------------- records


@dataclasses.dataclass
class Record:
    api: str
    bytes: int
    handle_type: Optional[str] = None
    device: Optional[int] = None
    held: bool = True

    def key(self) -> tuple:
        return (self.api, self.bytes, self.handle_type, self.held)


@dataclasses.dataclass
class Case:
    """The device facts one creation runs under (what the stand-ins answer)."""

    world_size: int
    rank: int
    granularity: int = 2 << 20
    multicast_granularity: int = 512 << 20
    # True: cuMulticastGetGranularity answers by the object's size, as H200's driver
    # does (measured, docs/gpu/mc-granularity-*.jsonl): 2 MiB up to a 2 MiB object,
    # multicast_granularity above it.
    multicast_by_size: bool = False
    fabric_supported: bool = False
    fabric_nvml_ok: bool = False
    imex_channel: bool = False
    multicast_supported: bool = True
    peers_multicast: Optional[bool] = None  # what the other ranks say in a bool vote
    current_device: int = 0
    device_count: int = 8
    torch_signal_pad: Optional[int] = None  # None: the installed torch's own pad


class Recorder:
    def __init__(self):
        self.case: Optional[Case] = None
        self.records: list = []
        self.recording = False
        self._handles: dict = {}
        self._next = itertools.count(0x1000)
        self._fds: list = []

    def start(self, case: Case) -> None:
        self.case = case
        self.records = []
        self._handles = {}
        self.recording = True

    def stop(self) -> list:
        self.recording = False
        self._close_fds()
        return [dataclasses.replace(r) for r in self.records]

    def add(self, record: Record, handle: Any = None) -> None:
        if self.recording:
            self.records.append(record)
            if handle is not None:
                self._handles[handle] = record

    def release(self, handle: Any) -> None:
        record = self._handles.pop(handle, None)
        if record is not None and self.recording:
            record.held = False

    def token(self) -> int:
        return next(self._next) << 21  # 2 MiB aligned fake addresses / handles

    def fd(self) -> int:
        """A real descriptor FlashInfer may close (a peer's POSIX handle)."""
        fd = os.open(os.devnull, os.O_RDONLY)
        self._fds.append(fd)
        return fd

    def _close_fds(self) -> None:
        # Close the descriptors FlashInfer kept (it closes peers' ones itself); only
        # descriptors that still point at /dev/null, so a reused number is left alone.
        null = os.stat(os.devnull)
        for fd in self._fds:
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_rdev, st.st_ino) == (null.st_rdev, null.st_ino):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = []


# --------------------------------------------------------------------------- driver


class _FabricHandle:
    def __init__(self, data: bytes):
        self.data = data


class FakeDriver:
    """Stand-in for the ``cuda.bindings.driver`` module object."""

    def __init__(self, real, rec: Recorder):
        self._real = real
        self._rec = rec
        self._ok = real.CUresult.CUDA_SUCCESS
        self._fabric = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        self._posix = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        attr = real.CUdevice_attribute
        self._attrs = {
            attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: "multicast_supported",
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: "fabric_supported",
        }

    def __getattr__(self, name):  # types, enums, structs: the real ones
        value = getattr(self._real, name)
        if name.startswith("cu") and callable(value):
            raise AssertionError(f"conformance stand-in: unexpected driver call {name}")
        return value

    def _handle_name(self, handle_type) -> str:
        if handle_type == self._fabric:
            return "fabric"
        if handle_type == self._posix:
            return "posix"
        return str(handle_type)

    # device / context
    def cuDeviceGet(self, ordinal):
        return (self._ok, int(ordinal))

    def cuDevicePrimaryCtxRetain(self, dev):
        return (self._ok, self._rec.token())

    def cuCtxSetCurrent(self, ctx):
        return (self._ok,)

    def cuCtxGetCurrent(self):
        return (self._ok, 1)

    def cuCtxGetDevice(self):
        return (self._ok, self._rec.case.current_device if self._rec.case else 0)

    def cuCtxSynchronize(self):
        return (self._ok,)

    def cuDeviceGetAttribute(self, attribute, device):
        name = self._attrs.get(attribute)
        if name is None:
            raise AssertionError(f"conformance stand-in: unexpected attribute {attribute}")
        return (self._ok, int(bool(getattr(self._rec.case, name))))

    def cuGetErrorName(self, error):
        return (self._ok, str(getattr(error, "name", error)).encode())

    # granularity
    def cuMemGetAllocationGranularity(self, prop, flags):
        return (self._ok, self._rec.case.granularity)

    def cuMulticastGetGranularity(self, prop, flags):
        case = self._rec.case
        if case.multicast_by_size and int(prop.size) <= 2 << 20:
            return (self._ok, 2 << 20)
        return (self._ok, case.multicast_granularity)

    # physical memory
    def cuMemCreate(self, size, prop, flags):
        handle = self._rec.token()
        self._rec.add(Record("cuMemCreate", int(size),
                             self._handle_name(prop.requestedHandleTypes),
                             int(prop.location.id)), handle)
        return (self._ok, handle)

    def cuMemRelease(self, handle):
        self._rec.release(handle)
        return (self._ok,)

    def cuMemExportToShareableHandle(self, handle, handle_type, flags):
        if handle_type == self._fabric:
            if not self._rec.case.imex_channel:
                return (self._real.CUresult.CUDA_ERROR_NOT_PERMITTED, None)
            return (self._ok, _FabricHandle(b"\x01" * 64))
        return (self._ok, self._rec.fd())

    def cuMemImportFromShareableHandle(self, shareable, handle_type):
        return (self._ok, self._rec.token())

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        return (self._ok, self._rec.token())

    def cuMemAddressFree(self, ptr, size):
        return (self._ok,)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        return (self._ok,)

    def cuMemUnmap(self, ptr, size):
        return (self._ok,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        return (self._ok,)

    # multicast objects (no physical memory of their own)
    def cuMulticastCreate(self, prop):
        return (self._ok, self._rec.token())

    def cuMulticastAddDevice(self, handle, device):
        return (self._ok,)

    def cuMulticastBindMem(self, *args):
        return (self._ok,)

    def cuMulticastUnbind(self, *args):
        return (self._ok,)

    # plain device memory
    def cuMemAlloc(self, size):
        self._rec.add(Record("cuMemAlloc", int(size)))
        return (self._ok, self._rec.token())

    def cuMemFree(self, ptr):
        return (self._ok,)

    def cuMemcpyHtoD(self, *args):
        return (self._ok,)

    def cuMemsetD8(self, *args):
        return (self._ok,)

    def cuMemsetD16(self, *args):
        return (self._ok,)

    def cuMemsetD32(self, *args):
        return (self._ok,)


class FakeCudart:
    """Stand-in for FlashInfer's ctypes ``cudart`` object (CudaRTLibrary)."""

    def __init__(self, rec: Recorder):
        self._rec = rec

    def cudaMalloc(self, size):
        self._rec.add(Record("cudaMalloc", int(size)))
        return ctypes.c_void_p(self._rec.token())

    def cudaFree(self, ptr):
        return None

    def cudaMemset(self, ptr, value, count):
        return None

    def cudaMemcpy(self, dst, src, count):
        return None

    def cudaIpcGetMemHandle(self, ptr):
        return ("ipc-handle", getattr(ptr, "value", ptr))

    def cudaIpcOpenMemHandle(self, handle):
        return ctypes.c_void_p(self._rec.token())

    def cudaIpcCloseMemHandle(self, ptr):
        return None

    def cudaSetDevice(self, device):
        return None

    def cudaDeviceSynchronize(self):
        return None


class FakeNvml:
    """Stand-in for ``pynvml`` as bound in flashinfer.comm.mnnvl."""

    def __init__(self, real, rec: Recorder):
        self._real = real
        self._rec = rec

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nvmlInit(self):
        return None

    def nvmlShutdown(self):
        return None

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetGpuFabricInfoV(self, handle, info):
        info = getattr(info, "_obj", info)  # ctypes.byref(...)
        ok = self._rec.case.fabric_nvml_ok
        info.state = (self._real.NVML_GPU_FABRIC_STATE_COMPLETED if ok
                      else self._real.NVML_GPU_FABRIC_STATE_NOT_STARTED)
        for i in range(len(info.clusterUuid)):
            info.clusterUuid[i] = 7 if ok else 0
        return None


class FakeIpcSocket:
    """Stand-in for mnnvl.IpcSocket (the ≤0.6.15 POSIX-fd transport)."""

    recorder: Recorder = None  # set by install()

    def __init__(self, rank, op_id, use_abstract=True):
        self.rank = rank

    def send_fd(self, fd, dest_rank, dest_op_id=None):
        return None

    def recv_fd(self):
        return self.recorder.fd()

    def close(self):
        return None


class FakeComm:
    """The CommBackend FlashInfer's own collectives run over: one process plays rank
    ``rank`` of ``world_size``; a gather returns this rank's value for every rank,
    except a bool vote, where the other ranks answer ``peers_bool`` when given."""

    def __init__(self, rank: int, world_size: int, peers_bool: Optional[bool] = None):
        self.rank, self.world_size, self.peers_bool = rank, world_size, peers_bool

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.world_size

    def allgather(self, data):
        if isinstance(data, bool) and self.peers_bool is not None:
            return [data if r == self.rank else self.peers_bool for r in range(self.world_size)]
        return [data] * self.world_size

    def bcast(self, data, root: int):
        return data

    def barrier(self) -> None:
        return None

    def Split(self, color: int, key: int):
        return self


class FakeGroup:
    group_name = "conformance-world"


class _SymmHandle:
    def __init__(self, size: int, world_size: int, rec: Recorder):
        self.buffer_size = size
        self.buffer_ptrs = [rec.token() for _ in range(world_size)]
        self.buffer_ptrs_dev = rec.token()
        self.signal_pad_ptrs_dev = rec.token()
        self.multicast_ptr = rec.token()

    def get_buffer(self, peer, sizes, dtype, storage_offset=0):
        ptr = self.buffer_ptrs[peer]
        return types.SimpleNamespace(data_ptr=lambda: ptr)


# --------------------------------------------------------------------------- install


def torch_signal_pad() -> int:
    """The signal pad torch's CUDA symmetric-memory backend adds to every block, asked
    of torch itself (torch releases before ``get_signal_pad_size`` used 2048)."""
    from torch.distributed import _symmetric_memory as symm

    query = getattr(symm, "get_signal_pad_size", None)
    return int(query()) if query is not None else 2048


def install(monkeypatch, rec: Recorder) -> None:
    """Install every stand-in (undone by ``monkeypatch``)."""
    import cuda.bindings.driver as real_driver
    import cuda.bindings.runtime as real_runtime
    import pynvml as real_pynvml
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from flashinfer.comm import cuda_ipc

    driver = FakeDriver(real_driver, rec)
    cudart = FakeCudart(rec)
    nvml = FakeNvml(real_pynvml, rec)
    FakeIpcSocket.recorder = rec
    cudart_types = tuple(t for t in (getattr(cuda_ipc, "CudaRTLibrary", None),
                                     getattr(cuda_ipc, "_LazyCudaRTLibrary", None)) if t)

    # Rebind every FlashInfer module attribute that is the driver module, the cudart
    # object or pynvml (FlashInfer binds them with `from … import …`).
    for name, module in list(sys.modules.items()):
        if not (name == "flashinfer" or name.startswith("flashinfer.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is real_driver:
                monkeypatch.setattr(module, attr, driver)
            elif cudart_types and isinstance(value, cudart_types):
                monkeypatch.setattr(module, attr, cudart)
            elif value is real_pynvml:
                monkeypatch.setattr(module, attr, nvml)

    import flashinfer.comm.mnnvl as mnnvl
    import flashinfer.comm.trtllm_ar as trtllm_ar

    if hasattr(mnnvl, "IpcSocket"):
        monkeypatch.setattr(mnnvl, "IpcSocket", FakeIpcSocket)
    if hasattr(mnnvl, "exchange_fds"):
        def exchange_fds(comm, fd):
            return [fd if r == comm.Get_rank() else rec.fd() for r in range(comm.Get_size())]

        def broadcast_fd(comm, fd, root):
            return fd if comm.Get_rank() == root else rec.fd()

        monkeypatch.setattr(mnnvl, "exchange_fds", exchange_fds)
        monkeypatch.setattr(mnnvl, "broadcast_fd", broadcast_fd)
    monkeypatch.setattr(real_runtime, "cudaSetDevice",
                        lambda device: (real_runtime.cudaError_t.cudaSuccess,))

    # The Lamport init kernel (JIT-compiled CUDA) touches no new memory.
    for name in ("trtllm_lamport_initialize", "trtllm_lamport_initialize_all"):
        if hasattr(trtllm_ar, name):
            monkeypatch.setattr(trtllm_ar, name, lambda *args, **kwargs: None)

    # torch symmetric memory (allocator C): our model of torch's CUDA backend.
    def symm_empty(*size, dtype=None, device=None, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        request = tensor.numel() * tensor.element_size()
        case = rec.case
        pad = torch_signal_pad() if case.torch_signal_pad is None else case.torch_signal_pad
        block = -(-(-(-request // 16) * 16 + pad) // case.granularity) * case.granularity
        rec.add(Record("cuMemCreate", block, "posix", case.current_device))
        tensor._fiws_request = request
        return tensor

    def symm_rendezvous(tensor, group=None):
        ws = rec.case.world_size
        rec.add(Record("torch", 8 * ws))  # raw_alloc(8*ws): buffer pointer array
        rec.add(Record("torch", 8 * ws))  # raw_alloc(8*ws): signal pad pointer array
        return _SymmHandle(getattr(tensor, "_fiws_request", 0), ws, rec)

    monkeypatch.setattr(symm_mem, "empty", symm_empty)
    monkeypatch.setattr(symm_mem, "rendezvous", symm_rendezvous)

    # torch.tensor(..., device="cuda") -> CPU, recorded.
    real_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            made = real_tensor(data, *args, **kwargs)
            rec.add(Record("torch", made.numel() * made.element_size()))
            return made
        return real_tensor(data, *args, device=device, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: rec.case.current_device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: rec.case.device_count)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    # torch.distributed: one process plays one rank of a group of ws.
    def all_gather_object(out, obj, group=None):
        for i in range(len(out)):
            out[i] = obj

    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=FakeGroup()))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: rec.case.world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rec.case.rank)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)


# --------------------------------------------------------------------------- mnnvl-cutedsl


def _remote_tensor(self, peer, sizes, dtype, storage_offset=0):
    ptr = self.buffer_ptrs[peer]
    return types.SimpleNamespace(data_ptr=lambda: ptr)


_SymmHandle.get_remote_tensor = _remote_tensor


class _Compiled:
    """What a stubbed CuTe DSL compile returns: never launched here."""

    def __init__(self, name: str):
        self.name = name


@contextlib.contextmanager
def cutedsl_device(rec: Recorder, compute_capability: tuple):
    """Extra stand-ins while one MNNVLCuteDSLAllReduceFusionWorkspace is built (allocator D).

    * ``torch.cuda.is_available`` / ``get_device_capability``: a Blackwell device of the
      given compute capability;
    * ``symm_mem.get_backend``: torch's "CUDA" symmetric-memory backend (the
      allocations themselves are the stand-ins of ``install``);
    * every protocol's ``_compile*`` method (the CuTe DSL JIT): returns a placeholder
      and allocates nothing; recorded in ``compiled``;
    * ``torch.zeros`` / ``torch.empty`` on a CUDA device, and ``torch.tensor`` on the
      meta device our symmetric tensors live on: made on the CPU and recorded as
      "torch" allocations of numel·element_size bytes.
    Yields the list of compiled kernel names.
    """
    import torch.distributed._symmetric_memory as symm_mem
    from flashinfer.comm.mnnvl_cutedsl.kernel_bt.protocol import BTProtocol
    from flashinfer.comm.mnnvl_cutedsl.kernel_ht.protocol import HTProtocol
    from flashinfer.comm.mnnvl_cutedsl.kernel_ll.protocol import LLProtocol

    compiled: list = []
    mp = __import__("pytest").MonkeyPatch()
    try:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability",
                   lambda *a, **k: tuple(compute_capability))
        mp.setattr(symm_mem, "get_backend", lambda *a, **k: "CUDA")
        for cls in (LLProtocol, BTProtocol, HTProtocol):
            for name in list(vars(cls)):
                if name.startswith("_compile"):
                    def stub(self, *args, _name=f"{cls.__name__}.{name}", **kwargs):
                        compiled.append(_name)
                        return _Compiled(_name)
                    mp.setattr(cls, name, stub)

        def on_device(real, devices):
            def make(*args, device=None, **kwargs):
                if device is not None and str(device).startswith(devices):
                    made = real(*args, **kwargs)
                    rec.add(Record("torch", made.numel() * made.element_size()))
                    return made
                return real(*args, device=device, **kwargs)
            return make

        mp.setattr(torch, "zeros", on_device(torch.zeros, ("cuda",)))
        mp.setattr(torch, "empty", on_device(torch.empty, ("cuda",)))
        mp.setattr(torch, "tensor", on_device(torch.tensor, ("cuda", "meta")))
        yield compiled
    finally:
        mp.undo()
