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
from . import rankfacts as _rf
from .rankfacts import Fabric, RankFacts

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
            bus = _check(self._drv.cuDeviceGetPCIBusId(32, dev))
            bus = bus.decode() if isinstance(bus, (bytes, bytearray)) else str(bus)
            return nvml.fabric(bus.strip("\x00"))
        except nvml.NvmlUnavailable:
            return None

    def rank_facts(self, device: Optional[int] = None) -> RankFacts:
        """The checks' facts for this rank, read from the driver, NVML and the host."""
        drv = self._ready()
        dev = self.current_device() if device is None else int(device)
        uuid = _check(drv.cuDeviceGetUuid(_check(drv.cuDeviceGet(dev))))
        raw = getattr(uuid, "bytes", b"")
        raw = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)
        return RankFacts(
            host=_rf.host_identity(), gpu_uuid=bytes(raw).hex(), device=dev,
            device_count=int(_check(drv.cuDeviceGetCount())),
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
                 fabric: bool = False, mc_granularity=None, **rank_facts):
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
        unknown = set(rank_facts) - set(SIM_FACTS)
        if unknown:
            raise TypeError(f"SimulatedDevice: unknown facts {sorted(unknown)}")
        self.sim = dict(SIM_FACTS, **rank_facts)  # the checks' facts, settable per rank
        self.exports_live = 0  # deep-probe exports not yet released (0 when none runs)
        self.imports = 0

    def facts(self, device: Optional[int], confidential_compute: bool, world_size: int) -> Facts:
        fab = self._fabric()
        return Facts(granularity=self.granularity, multicast_supported=self.multicast,
                     fabric_supported=self.fabric, confidential_compute=confidential_compute,
                     fabric_nvml_ok=self.fabric and flashinfer_picks_fabric(fab),
                     imex_channel=bool(self.sim["imex_channel"]),
                     current_device=self.device if device is None else device,
                     device_count=int(self.sim["device_count"]))

    def _fabric(self) -> Optional[Fabric]:
        if self.sim["fabric_state"] is None:
            return None
        return Fabric(int(self.sim["fabric_state"]), int(self.sim["fabric_status"]),
                      str(self.sim["cluster_uuid"]))

    def rank_facts(self, device: Optional[int] = None) -> RankFacts:
        if self.sim["facts_error"] is not None:
            raise self.sim["facts_error"]
        s = self.sim
        return RankFacts(
            host=s["host"] or _rf.host_identity(), gpu_uuid=s["gpu_uuid"] or f"sim-gpu-{os.getpid()}",
            device=self.device if device is None else device, device_count=int(s["device_count"]),
            multicast=self.multicast, fabric_handles=self.fabric, fabric=self._fabric(),
            imex_channel=bool(s["imex_channel"]), capturing=bool(s["capturing"]) or capturing(),
            packages=tuple(s["packages"]) if s["packages"] is not None else _rf.packages())

    def export_handle(self, handle: str, device: Optional[int] = None):
        if self.sim["export_error"]:
            raise RuntimeError(f"simulated export failure: {self.sim['export_error']}")
        self.exports_live += 1
        token = {"sim": handle, "pid": os.getpid(), "refuse": bool(self.sim["refuse_import"])}
        return token, token

    def import_handle(self, handle: str, token: dict, device: Optional[int] = None) -> None:
        if token.get("refuse") or self.sim["import_error"]:
            raise RuntimeError("simulated import failure: CUDA_ERROR_INVALID_DEVICE")
        if token.get("sim") != handle:
            raise RuntimeError(f"handle type {token.get('sim')!r} imported as {handle!r}")
        self.imports += 1

    def release_export(self, keep) -> None:
        self.exports_live -= 1

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


# what a SimulatedDevice answers for the checks unless a test sets it (per rank)
SIM_FACTS = {
    "host": "",  # "": this machine's identity
    "gpu_uuid": "",  # "": one GPU per process
    "device_count": 8,
    "fabric_state": None,  # None: NVML has no fabric info; else Fabric.* state
    "fabric_status": 0,
    "cluster_uuid": "0" * 32,
    "imex_channel": False,
    "capturing": False,
    "packages": None,  # None: the installed packages
    "facts_error": None,  # an exception rank_facts raises (a check that itself fails)
    "export_error": "",  # deep probe: this rank cannot export
    "import_error": "",  # deep probe: this rank cannot import a peer's handle
    "refuse_import": False,  # deep probe: no peer can import this rank's handle
}


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
