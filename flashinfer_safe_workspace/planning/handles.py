"""The deep probe's driver side: export one granule with a handle type, import a peer's.

POSIX file descriptors cross processes with ``pidfd_getfd`` (Linux 5.6+, the caller must
be allowed to ptrace the exporter, as FlashInfer's own fd exchange before 0.6.16
required); FABRIC handles are 64 bytes and travel as hex. Every allocation, imported
handle and descriptor is released on every path. Nothing here creates a multicast object.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from .driver import checked

SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64 (generic syscall table)


@contextlib.contextmanager
def _context(prober, dev: int):
    drv = prober.driver()
    cu_dev = checked(drv.cuDeviceGet(dev))
    ctx = checked(drv.cuDevicePrimaryCtxRetain(cu_dev))
    try:
        checked(drv.cuCtxPushCurrent(ctx))
        try:
            yield drv
        finally:
            drv.cuCtxPopCurrent()
    finally:
        drv.cuDevicePrimaryCtxRelease(cu_dev)


def _type(drv, handle: str):
    types = drv.CUmemAllocationHandleType
    return (types.CU_MEM_HANDLE_TYPE_FABRIC if handle == "fabric"
            else types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)


def export(prober, handle: str, dev: int):
    """``(token, keep)``: one granule of ``handle`` type, exported. ``keep`` is released
    by :func:`release`; on a failure here everything made so far is released."""
    with _context(prober, dev) as drv:
        prop = prober.allocation_prop(dev, handle, False)
        gran = int(checked(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        mem = checked(drv.cuMemCreate(gran, prop, 0))
        try:
            shared = checked(drv.cuMemExportToShareableHandle(mem, _type(drv, handle), 0))
        except BaseException:
            drv.cuMemRelease(mem)
            raise
    if handle == "fabric":
        data = bytes(getattr(shared, "data", b""))
        return {"type": handle, "fabric": data.hex(), "pid": os.getpid()}, (dev, mem, None)
    fd = int(shared)
    return {"type": handle, "fd": fd, "pid": os.getpid()}, (dev, mem, fd)


def release(prober, keep) -> None:
    dev, mem, fd = keep
    try:
        with _context(prober, dev) as drv:
            drv.cuMemRelease(mem)
    finally:
        if fd is not None:
            os.close(fd)


def _pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


def import_release(prober, handle: str, token: dict, dev: int) -> None:
    """Import a peer's exported granule and release the import at once; raises on failure."""
    if token.get("type") != handle:
        raise RuntimeError(f"the peer exported {token.get('type')!r}, this rank expects {handle!r}")
    local_fd = None
    with _context(prober, dev) as drv:
        if handle == "fabric":
            shared = drv.CUmemFabricHandle()
            shared.data = bytes.fromhex(token["fabric"])
        else:
            local_fd = _pidfd_getfd(int(token["pid"]), int(token["fd"]))
            shared = local_fd
        try:
            mem = checked(drv.cuMemImportFromShareableHandle(shared, _type(drv, handle)))
            drv.cuMemRelease(mem)
        finally:
            if local_fd is not None:
                os.close(local_fd)
