"""NVML, through nvidia-ml-py's ``pynvml`` (FlashInfer installs it): the GPU fabric state.

Initialised once per process, never at import time. A GPU is found by its PCI bus id
(robust under ``CUDA_VISIBLE_DEVICES``, unlike the CUDA ordinal). Every failure of NVML
itself raises ``NvmlUnavailable``; a GPU or driver without fabric info answers ``None``.
"""

from __future__ import annotations

import threading
from typing import Optional

from .rankfacts import Fabric

_lock = threading.Lock()
_ready = False


class NvmlUnavailable(RuntimeError):
    """pynvml not importable, or nvmlInit failed."""


def _nvml():
    global _ready
    try:
        import pynvml
    except Exception as exc:  # noqa: BLE001
        raise NvmlUnavailable(f"pynvml not importable: {exc}") from None
    with _lock:
        if not _ready:
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # noqa: BLE001
                raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
            _ready = True
    return pynvml


def fabric(pci_bus_id: str) -> Optional[Fabric]:
    """The fabric info of the GPU at ``pci_bus_id``, or None where NVML has none."""
    nv = _nvml()
    handle = nv.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
    info_t = getattr(nv, "c_nvmlGpuFabricInfoV_t", None)
    try:
        if info_t is not None and hasattr(nv, "nvmlDeviceGetGpuFabricInfoV"):
            info = info_t()
            if hasattr(nv, "nvmlGpuFabricInfo_v2"):
                info.version = nv.nvmlGpuFabricInfo_v2
            nv.nvmlDeviceGetGpuFabricInfoV(handle, nv.byref(info) if hasattr(nv, "byref")
                                           else info)
        else:
            info = nv.nvmlDeviceGetGpuFabricInfo(handle)
    except nv.NVMLError as exc:
        not_supported = (getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3),
                         getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))
        if getattr(exc, "value", None) in not_supported:
            return None
        raise
    uuid = bytes(bytearray(info.clusterUuid)).hex()
    state = int(info.state)
    if state == Fabric.NOT_SUPPORTED:
        return None
    return Fabric(state=state, status=int(info.status), cluster_uuid=uuid)
