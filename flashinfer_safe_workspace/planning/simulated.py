"""A stand-in GPU for machines without one: ``SimulatedDevice`` answers the probe
interface (facts, the checks' facts, the deep probe's handles, the probe itself) from
per-rank numbers and settable faults; everything above that interface is the real code.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from .plan import DEFAULT_GRANULARITY, Facts, Plan, round_up
from . import rankfacts as _rf
from .probe import (CUDA_ERROR_OUT_OF_MEMORY, FailedAllocation, ProbeResult, capturing,
                    flashinfer_picks_fabric)
from .rankfacts import Fabric, RankFacts


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
                    result.failed = FailedAllocation(name, size, CUDA_ERROR_OUT_OF_MEMORY,
                                                     "CUDA_ERROR_OUT_OF_MEMORY")
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
