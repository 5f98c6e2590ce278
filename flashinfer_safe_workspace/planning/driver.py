"""The CUDA driver's bindings and their result tuples: shared by the probe and the deep
probe's handle export/import (``handles``), which both talk to the driver.

``ProbeUnavailable``, ``driver_module``, ``checked`` and ``CudaError`` are also reachable as
``probe.<name>``, where every caller outside ``planning`` names them.
"""

from __future__ import annotations


class ProbeUnavailable(RuntimeError):
    """No driver, no bindings, no device: this rank cannot probe."""


def driver_module():
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


def checked(result):
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
