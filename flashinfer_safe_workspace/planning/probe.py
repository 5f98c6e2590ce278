"""The probe: can this rank's GPU hold the whole plan (plus headroom) right now?

``CudaProber`` creates every held allocation of the plan with the same
``CUmemAllocationProp`` FlashInfer uses (type, location, handle type,
``gpuDirectRDMACapable``), holds them all at once with the headroom, and releases
every one on every path. It never calls ``cuMulticastCreate``; granularity queries
create nothing. ``simulated.SimulatedDevice`` answers the same interface on machines
without a GPU; everything above the probe interface is the real code.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Optional

from .plan import DEFAULT_GRANULARITY, DEFAULT_MC_GRANULARITY, Facts, Plan, round_up
from . import rankfacts as _rf
from .rankfacts import Fabric, RankFacts

# the driver's bindings (shared with handles); callers outside planning name them here
from .driver import CudaError, ProbeUnavailable, checked, driver_module

from .._reasons import OK, OUT_OF_MEMORY, PROBE_ERROR

IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"


CUDA_ERROR_OUT_OF_MEMORY = 2  # the driver's CUresult for an allocation that does not fit


@dataclasses.dataclass(frozen=True)
class FailedAllocation:
    """The first allocation the probe could not make, and the driver's error for it."""

    name: str  # a planned allocation's name, or "headroom"
    size: int
    cuda_error: int
    cuda_error_name: str

    @property
    def reason(self) -> int:
        return OUT_OF_MEMORY if self.cuda_error == CUDA_ERROR_OUT_OF_MEMORY else PROBE_ERROR


NOTHING_FAILED = FailedAllocation("", 0, 0, "")


@dataclasses.dataclass
class ProbeResult:
    """What one probe found: the device's memory, and whether the plan and the headroom
    fit at once (``ok``) or which allocation failed first (``failed``)."""

    ok: bool
    device: int = -1
    free_bytes: int = -1  # cuMemGetInfo, before the first allocation (-1: not read)
    total_bytes: int = -1
    elapsed_s: float = 0.0
    failed: FailedAllocation = NOTHING_FAILED

    @property
    def reason(self) -> int:
        return OK if self.ok else self.failed.reason


class DriverQueryFailed(RuntimeError):
    """A driver query the plan depends on (attribute, granularity) failed."""


class CudaProber:
    """Real probe on the rank's GPU through the CUDA driver API."""

    name = "cuda"

    def __init__(self):
        self._drv = None

    def driver(self):
        if self._drv is None:
            drv = driver_module()
            try:
                checked(drv.cuInit(0))
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

    def allocation_prop(self, device: int, handle: Optional[str], rdma: bool):
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
            return int(checked(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), device)))
        except Exception as exc:
            raise DriverQueryFailed(f"cuDeviceGetAttribute({name}) failed: {exc}") from None

    def facts(self, device: Optional[int], confidential_compute: bool, world_size: int) -> Facts:
        drv = self.driver()
        dev = self.current_device() if device is None else int(device)
        prop = self.allocation_prop(dev, "posix", True)
        gran = int(checked(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        multicast = bool(self._attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", dev))
        mc_gran = None
        if multicast:  # for a typical large object; plans ask per size (multicast_granularity)
            try:
                mc_gran = self.multicast_granularity(dev, world_size, 1 << 30, "posix")
            except Exception as exc:
                raise DriverQueryFailed(f"cuMulticastGetGranularity failed: {exc}") from None
        count = int(checked(drv.cuDeviceGetCount()))
        major = self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", dev)
        minor = self._attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR", dev)
        fabric_attr = bool(self._attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", dev))
        return Facts(
            granularity=gran or DEFAULT_GRANULARITY,
            multicast_granularity=mc_gran or DEFAULT_MC_GRANULARITY,
            fabric_supported=fabric_attr,
            fabric_nvml_ok=fabric_attr and flashinfer_picks_fabric(self._fabric(dev)),
            multicast_supported=multicast,
            confidential_compute=confidential_compute,
            current_device=dev,
            device_count=count,
            compute_capability=(major, minor),
            **_extra_facts(),
        )

    def _fabric(self, dev: int) -> Optional[Fabric]:
        """NVML's fabric info for ``dev`` (None: none, or NVML unavailable: FlashInfer then
        does not pick FABRIC either, 0.6.0–0.7.2.post1 raise on an NVML error)."""
        from . import nvml

        try:
            bus = checked(self._drv.cuDeviceGetPCIBusId(32, dev))
            bus = bus.decode() if isinstance(bus, (bytes, bytearray)) else str(bus)
            return nvml.fabric(bus.strip("\x00"))
        except nvml.NvmlUnavailable:
            return None

    def rank_facts(self, device: Optional[int] = None) -> RankFacts:
        """The checks' facts for this rank, read from the driver, NVML and the host."""
        drv = self.driver()
        dev = self.current_device() if device is None else int(device)
        uuid = checked(drv.cuDeviceGetUuid(checked(drv.cuDeviceGet(dev))))
        raw = getattr(uuid, "bytes", b"")
        raw = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)
        return RankFacts(
            host=_rf.host_identity(), gpu_uuid=bytes(raw).hex(), device=dev,
            device_count=int(checked(drv.cuDeviceGetCount())),
            multicast=bool(self._attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", dev)),
            fabric_handles=bool(self._attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", dev)),
            fabric=self._fabric(dev), imex_channel=_rf.imex_channel(), capturing=capturing(),
            packages=_rf.packages())

    def export_handle(self, handle: str, device: Optional[int] = None):
        """One granule created with ``handle`` ("posix"/"fabric") and exported: returns
        ``(token, keep)``; ``token`` is JSON-able for the peers, ``keep`` goes back to
        :meth:`release_export` on every path."""
        from . import handles

        return handles.export(self, handle, self.current_device() if device is None else device)

    def import_handle(self, handle: str, token: dict, device: Optional[int] = None) -> None:
        """Import a peer's token and release it at once; raises on failure."""
        from . import handles

        handles.import_release(self, handle, token,
                               self.current_device() if device is None else device)

    def release_export(self, keep) -> None:
        from . import handles

        handles.release(self, keep)

    def multicast_granularity(self, device: Optional[int], world_size: int, size: int,
                              handle: Optional[str]) -> Optional[int]:
        """RECOMMENDED multicast granularity for an object of ``size`` bytes over
        ``world_size`` devices, queried the way FlashInfer queries it (the answer depends
        on the size: 2 MiB for a 2 MiB object on H200). A query only: nothing is created."""
        drv = self.driver()
        dev = self.current_device() if device is None else int(device)
        if not self._attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", dev):
            return None
        mc = drv.CUmulticastObjectProp()
        mc.numDevices = max(int(world_size), 1)
        mc.size = int(size)
        types = drv.CUmemAllocationHandleType
        mc.handleTypes = (types.CU_MEM_HANDLE_TYPE_FABRIC if handle == "fabric"
                          else types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return int(checked(drv.cuMulticastGetGranularity(
            mc, drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED)))

    def probe(self, plan: Plan, headroom_bytes: int, device: Optional[int] = None) -> ProbeResult:
        drv = self.driver()
        dev = plan.device if plan.device is not None else (
            self.current_device() if device is None else device)
        start = time.perf_counter()
        result = ProbeResult(ok=False, device=dev)
        cu_dev = checked(drv.cuDeviceGet(dev))
        ctx = checked(drv.cuDevicePrimaryCtxRetain(cu_dev))
        created = []  # (kind, handle)
        pushed = False
        try:
            checked(drv.cuCtxPushCurrent(ctx))
            pushed = True
            free, total = checked(drv.cuMemGetInfo())
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
                        prop = self.allocation_prop(dev, handle, rdma)
                        if name == "headroom":
                            gran = int(checked(drv.cuMemGetAllocationGranularity(
                                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
                            size = round_up(size, gran)
                        created.append(("mem", checked(drv.cuMemCreate(size, prop, 0))))
                    else:  # cudaMalloc / cuMemAlloc / torch: a plain device allocation
                        created.append(("ptr", checked(drv.cuMemAlloc(max(int(size), 1)))))
                except CudaError as exc:
                    result.failed = FailedAllocation(name, int(size), exc.code, exc.name)
                    return result
            result.ok = True
            return result
        finally:
            errors = []
            for kind, handle in reversed(created):
                try:
                    checked(drv.cuMemRelease(handle) if kind == "mem" else drv.cuMemFree(handle))
                except Exception as exc:  # keep releasing the rest
                    errors.append(exc)
            if pushed:
                try:
                    checked(drv.cuCtxPopCurrent())
                except Exception as exc:
                    errors.append(exc)
            try:
                checked(drv.cuDevicePrimaryCtxRelease(cu_dev))
            except Exception as exc:
                errors.append(exc)
            result.elapsed_s = time.perf_counter() - start
            if errors:
                from .._log import internal_error
                internal_error("probe.release", errors[0])


def _extra_facts() -> dict:
    return {"imex_channel": os.path.exists(IMEX_CHANNEL)}


def flashinfer_picks_fabric(fabric: Optional[Fabric]) -> bool:
    """FlashInfer 0.6.0–0.7.2.post1's own NVML test for FABRIC handles: state completed
    and a cluster UUID (it never looks at the status)."""
    return fabric is not None and fabric.state >= Fabric.COMPLETED and fabric.has_cluster


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no probe then)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


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
