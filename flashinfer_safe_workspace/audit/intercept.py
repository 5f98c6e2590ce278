"""What FlashInfer's own creation asks the CUDA layer for, recorded on this thread only.

The audit (``_audit``) compares it with the plan; this module only records: it patches
the driver object FlashInfer binds, its ctypes runtime and torch's symmetric-memory
``empty`` for the duration of one call, passes every call through unchanged (other
threads straight through, unrecorded), and restores everything on every path.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import threading
from typing import Any, Optional

from ..planning.plan import round_up

_DRIVER_AT = (("flashinfer.comm.mnnvl", "cuda"), ("flashinfer.comm.trtllm_mnnvl_ar", "cuda"))
_CUDART_AT = (("flashinfer.comm.cuda_ipc", "cudart"), ("flashinfer.comm.trtllm_ar", "cudart"))
_SYMM_MODULE = "torch.distributed._symmetric_memory"
_MISSING = object()
logger = logging.getLogger("flashinfer_safe_workspace")


@dataclasses.dataclass
class Seen:
    api: str
    bytes: int
    held: bool = True
    requested: int = 0  # torch-symm: the tensor's bytes before torch's rounding
    handle_type: Optional[str] = None


class Recorder:
    """Mixin: ``self.seen`` (list of Seen), ``self.apis`` (set), ``self._handles``,
    ``self._saved``, ``self._thread``, ``self._recording``, ``self.signal_pad``,
    ``self.granularity`` and ``self.reason`` are set up by the class using it."""

    # ------------------------------------------------------------------ patches

    def _install(self) -> None:
        done: set = set()
        for mod_name, attr in _DRIVER_AT:
            obj = getattr(sys.modules.get(mod_name), attr, None)
            if obj is None or id(obj) in done:
                continue
            done.add(id(obj))
            self._patch(obj, "cuMemCreate", self._on_create)
            self._patch(obj, "cuMemRelease", self._on_release)
            self._patch(obj, "cuMemAlloc", self._on_alloc("cuMemAlloc"))
            self._patch(obj, "cuMemFree", self._on_free)
            self.apis.update(("cuMemCreate", "cuMemAlloc"))
        for mod_name, attr in _CUDART_AT:
            obj = getattr(sys.modules.get(mod_name), attr, None)
            if obj is None or id(obj) in done:
                continue
            done.add(id(obj))
            self._patch(obj, "cudaMalloc", self._on_alloc("cudaMalloc"))
            self._patch(obj, "cudaFree", self._on_free)
            self.apis.add("cudaMalloc")
        symm = sys.modules.get(_SYMM_MODULE)
        if symm is not None and hasattr(symm, "empty"):
            self._patch(symm, "empty", self._on_symm)
            self.apis.add("torch-symm")

    def _patch(self, obj: Any, name: str, record) -> None:
        own = vars(obj).get(name, _MISSING)
        if own is not _MISSING:
            original = own
        else:  # a class method, or a lazy object's __getattr__ (resolved at call time)
            static = inspect.getattr_static(type(obj), name, _MISSING)
            if static is _MISSING:
                if not hasattr(type(obj), "__getattr__"):
                    return  # this binding has no such function: nothing to observe
                original = _late(obj, name)
            else:
                original = static.__get__(obj, type(obj)) if hasattr(static, "__get__") else static
        owner = self._owner
        audit = self

        def recording(*args, **kwargs):
            result = original(*args, **kwargs)
            if audit._recording and threading.get_ident() == owner:
                try:
                    record(args, kwargs, result)
                except Exception as exc:  # noqa: BLE001 - never disturb FlashInfer
                    audit.reason = f"recording failed: {type(exc).__name__}: {exc}"
            return result

        recording.__wrapped__ = original
        setattr(obj, name, recording)
        self._patches.append((obj, name, own, recording))

    def _restore(self) -> None:
        while self._patches:
            obj, name, own, ours = self._patches.pop()
            try:
                if vars(obj).get(name) is not ours:
                    continue  # someone replaced it meanwhile: leave theirs
                if own is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, own)
            except Exception as exc:  # noqa: BLE001
                logger.debug("flashinfer_safe_workspace: audit could not restore %s: %s",
                             name, exc)

    # ------------------------------------------------------------------ records

    def _on_create(self, args, kwargs, result) -> None:
        size = args[0] if args else kwargs.get("size")
        prop = args[1] if len(args) > 1 else kwargs.get("prop")
        seen = Seen("cuMemCreate", int(size), handle_type=_handle_type(prop))
        self.seen.append(seen)
        if not _succeeded(result):
            # a refused attempt (0.7.4 tries FABRIC first and falls back to POSIX fds when
            # the handle cannot be made): the plan lists it as a transient of the same size
            seen.held = False
            return
        self._handles[_key(result[1])] = seen

    def _on_release(self, args, kwargs, result) -> None:
        handle = args[0] if args else kwargs.get("handle")
        seen = self._handles.pop(_key(handle), None)
        if seen is not None and _succeeded(result):
            seen.held = False

    def _on_alloc(self, api: str):
        def record(args, kwargs, result):
            if api == "cuMemAlloc":
                if not _succeeded(result):
                    return
                ptr = result[1]
            else:
                ptr = result  # the ctypes wrapper raises on failure
            size = args[0] if args else next(iter(kwargs.values()))
            seen = Seen(api, int(size))
            self.seen.append(seen)
            self._handles[_key(ptr)] = seen
        return record

    def _on_free(self, args, kwargs, result) -> None:
        ptr = args[0] if args else next(iter(kwargs.values()), None)
        seen = self._handles.pop(_key(ptr), None)
        if seen is not None and (not isinstance(result, tuple) or _succeeded(result)):
            seen.held = False

    def _on_symm(self, args, kwargs, result) -> None:
        request = int(result.numel()) * int(result.element_size())
        block = round_up(round_up(request, 16) + self.signal_pad, self.granularity)
        self.seen.append(Seen("torch-symm", block, requested=request, handle_type="posix"))




def _late(obj, name):
    def call(*args, **kwargs):
        return type(obj).__getattr__(obj, name)(*args, **kwargs)
    return call


def _succeeded(result) -> bool:
    try:
        return int(result[0]) == 0
    except Exception:  # noqa: BLE001
        return False


def _key(handle):
    value = getattr(handle, "value", handle)  # ctypes.c_void_p
    try:
        return int(value)
    except Exception:  # noqa: BLE001
        return id(handle)


def _handle_type(prop) -> Optional[str]:
    text = str(getattr(getattr(prop, "requestedHandleTypes", None), "name", "")).upper()
    return "fabric" if "FABRIC" in text else "posix" if "POSIX" in text else None


