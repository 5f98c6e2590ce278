"""The facts the preflight checks read on this rank, besides the plan's own facts.

``RankFacts`` is what a prober answers to ``rank_facts(device)``: the real one reads the
CUDA driver, NVML (``nvml``) and the host; the simulated device answers what a test set.
The host-level readers here (host identity, IMEX channels, installed FlashInfer
packages) are plain functions, cheap: microseconds, and about 1 ms for the package
versions, read once per process from their `.dist-info` folders.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from typing import Optional

IMEX_DIR = "/dev/nvidia-caps-imex-channels"


@dataclasses.dataclass(frozen=True)
class Fabric:
    """NVML's GPU fabric info (``nvmlDeviceGetGpuFabricInfoV``)."""

    state: int  # NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress, 3 completed
    status: int  # an nvmlReturn_t; must be 0 (success) once the state is completed
    cluster_uuid: str  # hex; all zeros: no cluster

    NOT_SUPPORTED, NOT_STARTED, IN_PROGRESS, COMPLETED = 0, 1, 2, 3

    @property
    def has_cluster(self) -> bool:
        return bool(self.cluster_uuid.strip("0"))

    def text(self) -> str:
        return f"state={self.state} status={self.status} cluster={self.cluster_uuid or '-'}"


@dataclasses.dataclass(frozen=True)
class RankFacts:
    host: str  # host identity: hostname and boot id
    gpu_uuid: str  # the current device's UUID ("" when unknown)
    device: int  # the current device index
    device_count: int
    multicast: bool  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
    fabric_handles: bool  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
    fabric: Optional[Fabric]  # None: NVML has no fabric info for this GPU
    imex_channel: bool  # an IMEX channel this process can open
    capturing: bool  # the current stream is capturing a CUDA graph
    packages: tuple = ()  # (name, version) of flashinfer-python, -cubin, -jit-cache


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:8]
    except OSError:
        return "-"


def host_identity() -> str:
    """``hostname/boot-id``: two containers on one machine share the boot id, two
    machines with one hostname do not."""
    return f"{socket.gethostname()}/{_boot_id()}"


def imex_channel() -> bool:
    """Whether this process can open an IMEX channel (FABRIC handles need one)."""
    try:
        names = os.listdir(IMEX_DIR)
    except OSError:
        return False
    return any(n.startswith("channel") and os.access(os.path.join(IMEX_DIR, n), os.R_OK | os.W_OK)
               for n in names)


PACKAGES = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
_MODULES = {"flashinfer-python": "flashinfer", "flashinfer-cubin": "flashinfer_cubin",
            "flashinfer-jit-cache": "flashinfer_jit_cache"}


def _dist_version(name: str) -> str:
    """The installed version of ``name`` ("" when absent), cheaply: the ``.dist-info``
    folder next to its top-level module; ``importlib.metadata`` (which scans every path
    entry) only where that folder is elsewhere."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(_MODULES[name])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return ""
    where = os.path.dirname(os.path.dirname(spec.origin)) if spec.origin else ""
    prefix = name.replace("-", "_") + "-"
    try:
        for entry in os.listdir(where) if where else ():
            if entry.startswith(prefix) and entry.endswith(".dist-info"):
                return entry[len(prefix):-len(".dist-info")]
    except OSError:
        pass
    from importlib import metadata

    return metadata.version(name)


@functools.lru_cache(maxsize=1)
def packages() -> tuple:
    """``((name, version or ""), ...)`` of FlashInfer's packages, read once per process."""
    out = []
    for name in PACKAGES:
        try:
            out.append((name, _dist_version(name)))
        except Exception:  # noqa: BLE001 - broken or absent metadata: absent
            out.append((name, ""))
    return tuple(out)
