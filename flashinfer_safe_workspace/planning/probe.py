"""The probe: can this rank's GPU hold the whole plan (plus headroom) right now?

``CudaProber`` creates every held allocation of the plan with the same
``CUmemAllocationProp`` FlashInfer uses (type, location, handle type,
``gpuDirectRDMACapable``), holds them all at once with the headroom, and releases
every one on every path. It never calls ``cuMulticastCreate``; granularity queries
create nothing. ``SimulatedDevice`` stands in for a GPU on machines without one
(per-rank free bytes); everything above the probe interface is the real code.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Optional

from .plan import DEFAULT_GRANULARITY, DEFAULT_MC_GRANULARITY, Facts, Plan, round_up

from .._reasons import OK, OUT_OF_MEMORY, PROBE_ERROR

IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"


@dataclasses.dataclass
class ProbeResult:
    ok: bool
    reason: int = OK
    device: int = -1
    failed_name: str = ""
    failed_bytes: int = 0
    cuda_error: int = 0
    cuda_error_name: str = ""
    free_bytes: int = -1
    total_bytes: int = -1
    elapsed_s: float = 0.0


class ProbeUnavailable(RuntimeError):
    """No driver, no bindings, no device: this rank cannot probe."""


class DriverQueryFailed(RuntimeError):
    """A driver query the plan depends on (attribute, granularity) failed."""


# --------------------------------------------------------------------------- CUDA


def _driver():
    """The cuda-python driver module: 13.x ``cuda.bindings.driver`` or 12.x ``cuda.cuda``."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6 / 13.x
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python 12.x
        return driver
    except ImportError as exc:
        raise ProbeUnavailable(f"cuda-python driver bindings not importable: {exc}") from None


def _check(result):
    """Unpack a cuda-python ``(err, *values)`` tuple; raise ``CudaError`` on failure."""
    err = result[0]
    if int(err) != 0:
        raise CudaError(err)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class CudaError(RuntimeError):
    def __init__(self, err):
        self.code = int(err)
        self.name = getattr(err, "name", str(err))
        super().__init__(self.name)


class CudaProber:
    """Real probe on the rank's GPU through the CUDA driver API."""

    name = "cuda"

    def __init__(self):
        self._drv = None

    def _ready(self):
        if self._drv is None:
            drv = _driver()
            try:
                _check(drv.cuInit(0))
            except CudaError as exc:
                raise ProbeUnavailable(f"cuInit failed: {exc.name}") from None
            except Exception as exc:  # library not found etc.
                raise ProbeUnavailable(f"CUDA driver unavailable: {exc}") from None
            self._drv = drv
        return self._drv

    def current_device(self) -> int:
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                return int(torch.cuda.current_device())
            except Exception as exc:
                raise ProbeUnavailable(f"torch.cuda.current_device() failed: {exc}") from None
        raise ProbeUnavailable("torch is not imported")

    def _prop(self, device: int, handle: Optional[str], rdma: bool):
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = drv.CUmemLocation()
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        types = drv.CUmemAllocationHandleType
        if handle == "fabric":
            prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_FABRIC
        elif handle == "posix":
            prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        else:
            prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_NONE
        if rdma:
            prop.allocFlags.gpuDirectRDMACapable = 1
        return prop

    def _attr(self, name: str, device: int) -> int:
        """A device attribute. A query that fails raises (``DriverQueryFailed``): a plan
        built on a guessed attribute could switch protection off, so the rank says no."""
        drv = self._drv
        try:
            return int(_check(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), device)))
        except Exception as exc:
            raise DriverQueryFailed(f"cuDeviceGetAttribute({name}) failed: {exc}") from None

    def facts(self, device: Optional[int], confidential_compute: bool, world_size: int) -> Facts:
        drv = self._ready()
        dev = self.current_device() if device is None else int(device)
        prop = self._prop(dev, "posix", True)
        gran = int(_check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        multicast = bool(self._attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", dev))
        mc_gran = None
        if multicast:  # for a typical large object; plans ask per size (multicast_granularity)
            try:
                mc_gran = self.multicast_granularity(dev, world_size, 1 << 30, "posix")
            except Exception as exc:
                raise DriverQueryFailed(f"cuMulticastGetGranularity failed: {exc}") from None
        count = int(_check(drv.cuDeviceGetCount()))
        major = self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", dev)
        minor = self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR", dev)
        return Facts(
            granularity=gran or DEFAULT_GRANULARITY,
            multicast_granularity=mc_gran or DEFAULT_MC_GRANULARITY,
            fabric_supported=bool(self._attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", dev)),
            fabric_nvml_ok=False,
            multicast_supported=multicast,
            confidential_compute=confidential_compute,
            current_device=dev,
            device_count=count,
            compute_capability=(major, minor),
            **_extra_facts(),
        )

    def multicast_granularity(self, device: Optional[int], world_size: int, size: int,
                              handle: Optional[str]) -> Optional[int]:
        """RECOMMENDED multicast granularity for an object of ``size`` bytes over
        ``world_size`` devices, queried the way FlashInfer queries it (the answer depends
        on the size: 2 MiB for a 2 MiB object on H200). A query only: nothing is created."""
        drv = self._ready()
        dev = self.current_device() if device is None else int(device)
        if not self._attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", dev):
            return None
        mc = drv.CUmulticastObjectProp()
        mc.numDevices = max(int(world_size), 1)
        mc.size = int(size)
        types = drv.CUmemAllocationHandleType
        mc.handleTypes = (types.CU_MEM_HANDLE_TYPE_FABRIC if handle == "fabric"
                          else types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return int(_check(drv.cuMulticastGetGranularity(
            mc, drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED)))

    def probe(self, plan: Plan, headroom_bytes: int, device: Optional[int] = None) -> ProbeResult:
        drv = self._ready()
        dev = plan.device if plan.device is not None else (
            self.current_device() if device is None else device)
        start = time.perf_counter()
        result = ProbeResult(ok=False, device=dev)
        cu_dev = _check(drv.cuDeviceGet(dev))
        ctx = _check(drv.cuDevicePrimaryCtxRetain(cu_dev))
        created = []  # (kind, handle)
        pushed = False
        try:
            _check(drv.cuCtxPushCurrent(ctx))
            pushed = True
            free, total = _check(drv.cuMemGetInfo())
            result.free_bytes, result.total_bytes = int(free), int(total)
            rdma_c = bool(self._attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", dev))
            wanted = [(a.name, a.bytes, a.api, a.handle_type) for a in plan.probe_allocations]
            if headroom_bytes > 0:
                wanted.append(("headroom", headroom_bytes, "cuMemCreate", None))
            for name, size, api, handle in wanted:
                try:
                    if api == "cuMemCreate":
                        rdma = plan.allocator.startswith("B") if name != "headroom" else False
                        if plan.allocator == "C" and name != "headroom":
                            rdma = rdma_c
                        prop = self._prop(dev, handle, rdma)
                        if name == "headroom":
                            gran = int(_check(drv.cuMemGetAllocationGranularity(
                                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
                            size = round_up(size, gran)
                        created.append(("mem", _check(drv.cuMemCreate(size, prop, 0))))
                    else:  # cudaMalloc / cuMemAlloc / torch: a plain device allocation
                        created.append(("ptr", _check(drv.cuMemAlloc(max(int(size), 1)))))
                except CudaError as exc:
                    result.reason = OUT_OF_MEMORY if exc.code == 2 else PROBE_ERROR
                    result.failed_name, result.failed_bytes = name, int(size)
                    result.cuda_error, result.cuda_error_name = exc.code, exc.name
                    return result
            result.ok = True
            return result
        finally:
            errors = []
            for kind, handle in reversed(created):
                try:
                    _check(drv.cuMemRelease(handle) if kind == "mem" else drv.cuMemFree(handle))
                except Exception as exc:  # keep releasing the rest
                    errors.append(exc)
            if pushed:
                try:
                    _check(drv.cuCtxPopCurrent())
                except Exception as exc:
                    errors.append(exc)
            try:
                _check(drv.cuDevicePrimaryCtxRelease(cu_dev))
            except Exception as exc:
                errors.append(exc)
            result.elapsed_s = time.perf_counter() - start
            if errors:
                from .._log import internal_error
                internal_error("probe.release", errors[0])


def _extra_facts() -> dict:
    return {"imex_channel": os.path.exists(IMEX_CHANNEL)}


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no probe then)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------- simulated


class SimulatedDevice:
    """A stand-in GPU with a fixed number of free bytes, for machines without one.

    Faults for tests and the demo: ``delay_s`` (a slow probe), ``error`` (an exception
    raised by the probe), ``interrupt_after`` (KeyboardInterrupt after N allocations).
    ``live_bytes`` is what is held right now; it must be 0 whenever no probe runs.
    """

    name = "simulated"

    def __init__(self, free_bytes: int, *, total_bytes: Optional[int] = None,
                 granularity: int = DEFAULT_GRANULARITY, device: int = 0,
                 delay_s: float = 0.0, error: Optional[BaseException] = None,
                 interrupt_after: Optional[int] = None, multicast: bool = True,
                 fabric: bool = False, mc_granularity=None):
        self.free_bytes = int(free_bytes)
        self.total_bytes = int(total_bytes if total_bytes is not None else max(free_bytes, 0) + (1 << 30))
        self.granularity = granularity
        self.device = device
        self.delay_s = delay_s
        self.error = error
        self.interrupt_after = interrupt_after
        self.multicast = multicast
        self.fabric = fabric
        self.mc_granularity = mc_granularity  # size -> multicast granularity, or None
        self.live_bytes = 0
        self.probes = 0
        self.max_live_bytes = 0

    def facts(self, device: Optional[int], confidential_compute: bool, world_size: int) -> Facts:
        return Facts(granularity=self.granularity, multicast_supported=self.multicast,
                     fabric_supported=self.fabric, confidential_compute=confidential_compute,
                     current_device=self.device if device is None else device, device_count=8)

    def multicast_granularity(self, device, world_size, size, handle):
        return self.mc_granularity(size) if self.mc_granularity is not None else None

    def probe(self, plan: Plan, headroom_bytes: int, device: Optional[int] = None) -> ProbeResult:
        start = time.perf_counter()
        self.probes += 1
        dev = plan.device if plan.device is not None else self.device
        result = ProbeResult(ok=False, device=dev, free_bytes=self.free_bytes,
                             total_bytes=self.total_bytes)
        wanted = [(a.name, a.bytes) for a in plan.probe_allocations]
        if headroom_bytes > 0:
            wanted.append(("headroom", round_up(headroom_bytes, self.granularity)))
        held = []
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            for index, (name, size) in enumerate(wanted):
                if self.interrupt_after is not None and index >= self.interrupt_after:
                    raise KeyboardInterrupt("simulated interrupt during the probe")
                if self.error is not None and index == 1:
                    raise self.error
                if self.live_bytes + size > self.free_bytes:
                    result.reason = OUT_OF_MEMORY
                    result.failed_name, result.failed_bytes = name, size
                    result.cuda_error, result.cuda_error_name = 2, "CUDA_ERROR_OUT_OF_MEMORY"
                    return result
                self.live_bytes += size
                held.append(size)
                self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)
            result.ok = True
            return result
        finally:
            for size in held:
                self.live_bytes -= size
            result.elapsed_s = time.perf_counter() - start


# --------------------------------------------------------------------------- selection

_prober = None
_prober_lock = threading.Lock()


def get_prober():
    global _prober
    with _prober_lock:
        if _prober is None:
            _prober = CudaProber()
        return _prober


def set_prober(prober) -> None:
    """Replace the probe (tests, the demo without a GPU). ``None`` restores CUDA."""
    global _prober
    with _prober_lock:
        _prober = prober
