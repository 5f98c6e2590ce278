"""The self-audit: what FlashInfer's own creation really asked for, against the plan.

``watch`` wraps FlashInfer's creation call after a yes vote. While the block runs it
records, on the calling thread only, the allocations FlashInfer asks for:

* ``cuMemCreate`` / ``cuMemRelease`` and ``cuMemAlloc`` / ``cuMemFree`` through the
  driver object FlashInfer binds as ``flashinfer.comm.mnnvl.cuda`` (cuda-python 13
  ``cuda.bindings.driver`` or 12 ``cuda.cuda``: mnnvl.py, where SymmDeviceMemory and
  McastGPUBuffer allocate, binds it in every release 0.5–0.7.4);
* ``cudaMalloc`` / ``cudaFree`` through FlashInfer's ctypes runtime object
  (``flashinfer.comm.cuda_ipc.cudart``, also bound in ``trtllm_ar``);
* ``torch.distributed._symmetric_memory.empty`` (allocator C and D): the tensor's
  bytes S are observed; the block torch's CUDA allocator makes for it is
  RU(RU(S, 16) + P, G) with P the *installed* torch's ``get_signal_pad_size()``
  (torch's allocation itself happens in C++ and is not visible from Python, so
  this block is derived from the observed request and the runtime's pad).

Each of these is patched as an attribute of the object FlashInfer calls through (the
module, or the instance), so every binding of that object sees it; the wrapper calls
the original with the same arguments and returns its result untouched, and a call
from another thread goes straight through. Everything is restored when the block
ends, on every path. Our own failures never reach the caller: they make the audit
``skipped``.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import os
import sys
import threading
import time
from typing import Any, Optional

from ._plan import DEFAULT_GRANULARITY, Allocation, Plan, round_up

logger = logging.getLogger("flashinfer_safe_workspace")

OBSERVED_APIS = ("cuMemCreate", "cuMemAlloc", "cudaMalloc", "torch-symm")
# where FlashInfer binds the driver and its ctypes runtime (module, attribute)
_DRIVER_AT = (("flashinfer.comm.mnnvl", "cuda"), ("flashinfer.comm.trtllm_mnnvl_ar", "cuda"))
_CUDART_AT = (("flashinfer.comm.cuda_ipc", "cudart"), ("flashinfer.comm.trtllm_ar", "cudart"))
_SYMM_MODULE = "torch.distributed._symmetric_memory"
_FALLBACK_PAD = 2048

_lock = threading.Lock()
_busy = False  # one audit patched in at a time per process
_floors: dict = {}  # identity -> most held bytes observed for that call
_last: Optional["Audit"] = None
_warned = False
_pad: Optional[int] = None
_MISSING = object()


@dataclasses.dataclass
class Seen:
    api: str
    bytes: int
    held: bool = True
    requested: int = 0  # torch-symm: the tensor's bytes before torch's rounding
    handle_type: Optional[str] = None


class Audit:
    """One creation's audit. ``status``: "ok" | "mismatch" | "skipped" | "raised"."""

    def __init__(self, plan, request, version, identity, granularity):
        self.plan, self.request, self.version, self.identity = plan, request, version, identity
        self.granularity = int(granularity or DEFAULT_GRANULARITY)
        self.status = "skipped"
        self.reason = "not run"
        self.seen: list = []
        self.apis: set = set()  # what could be observed on this call
        self.signal_pad = _FALLBACK_PAD
        self.elapsed_s = 0.0
        self.overhead_s = 0.0  # our own time inside __enter__/__exit__
        self._owner = 0
        self._recording = False
        self._patches: list = []
        self._handles: dict = {}
        self._start = 0.0

    # ------------------------------------------------------------------ results

    @property
    def observed(self) -> list:
        return [(s.api, s.bytes) for s in self.seen]

    @property
    def expected(self) -> list:
        return [(api, n) for api, n, _ in _expected(self.plan, self.apis)]

    @property
    def observed_held_bytes(self) -> int:
        return sum(s.bytes for s in self.seen if s.held)

    def differences(self) -> tuple:
        """(observed but not planned, planned but not observed): (api, bytes, held)."""
        got = collections.Counter((s.api, s.bytes, s.held) for s in self.seen)
        want = collections.Counter(_expected(self.plan, self.apis))
        return sorted((got - want).elements()), sorted((want - got).elements())

    def report_line(self) -> str:
        """One line for an issue report: versions, the call, the differing allocations."""
        try:
            extra, missing = self.differences()
            plan = self.plan
            head = (f"fiws audit {self.status}: flashinfer={self.version} "
                    f"torch={_torch_version()} pid={os.getpid()} call={_describe(self.request)}")
            if isinstance(plan, Plan):
                head += (f" plan={plan.rules}/{plan.allocator}/{plan.backend} "
                         f"planned_held={_held(_expected(plan, self.apis))}")
            head += (f" observed_held={self.observed_held_bytes} signal_pad={self.signal_pad} "
                     f"G={self.granularity}")
            if self.status in ("skipped", "raised"):
                return head + f" ({self.reason})"
            return head + f" not_planned={_fmt(extra)} not_observed={_fmt(missing)}"
        except Exception as exc:  # noqa: BLE001 - a report must never raise
            return f"fiws audit {self.status}: (report failed: {type(exc).__name__})"

    # ------------------------------------------------------------------ the block

    def __enter__(self):
        global _busy
        began = time.perf_counter()
        try:
            with _lock:
                if _busy:
                    self.reason = "another audit is running in this process"
                    return self
                _busy = True
            try:
                self._owner = threading.get_ident()
                self.signal_pad = _signal_pad()
                self._install()
                self._recording = bool(self._patches)
                if not self._recording:
                    self.reason = "nothing to patch (no FlashInfer driver or runtime binding)"
            except BaseException:
                self._restore()
                raise
            finally:
                if not self._recording:
                    with _lock:
                        _busy = False
        except Exception as exc:  # noqa: BLE001 - our failure: no audit, no harm
            self.status, self.reason = "skipped", f"could not patch: {type(exc).__name__}: {exc}"
        self._start = time.perf_counter()
        self.overhead_s += self._start - began
        return self

    def __exit__(self, exc_type, exc, tb):
        global _busy, _last
        began = time.perf_counter()
        self.elapsed_s = began - self._start
        was_recording = self._recording
        self._recording = False
        try:
            self._restore()
        finally:
            if was_recording:
                with _lock:
                    _busy = False
        try:
            if exc_type is not None:
                self.status, self.reason = "raised", f"FlashInfer raised {exc_type.__name__}"
            elif was_recording:
                self._verdict()
            _last = self
            if self.identity is not None and self.status in ("ok", "mismatch"):
                try:
                    with _lock:
                        if self.observed_held_bytes > _floors.get(self.identity, 0):
                            _floors[self.identity] = self.observed_held_bytes
                except TypeError:  # an unhashable identity: no floor, verdict stands
                    pass
        except Exception as e:  # noqa: BLE001
            self.status, self.reason = "skipped", f"audit failed: {type(e).__name__}: {e}"
        self.overhead_s += time.perf_counter() - began
        return False  # FlashInfer's exception (if any) goes on untouched

    def _verdict(self) -> None:
        if self.reason.startswith("recording failed"):
            self.status = "skipped"
            return
        if not isinstance(self.plan, Plan):
            self.status, self.reason = "skipped", "no plan to compare"
            return
        if not self.seen:
            self.status, self.reason = "skipped", "nothing observable was allocated"
            return
        extra, missing = self.differences()
        self.status = "mismatch" if (extra or missing) else "ok"
        self.reason = "" if self.status == "ok" else "allocations differ from the plan"

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


# --------------------------------------------------------------------------- the API


def watch(plan, request, version, *, identity=None, granularity=None) -> Audit:
    """A context manager auditing FlashInfer's creation call run inside it.

    ``granularity``: the allocation granularity the plan used (torch rounds its
    symmetric blocks to it); default the H200's 2 MiB."""
    return Audit(plan, request, version, identity, granularity)


def warn_once(audit: Audit) -> None:
    """One WARNING per process, on the first mismatch."""
    global _warned
    try:
        if audit.status != "mismatch":
            return
        with _lock:
            if _warned:
                return
            _warned = True
        logger.warning("flashinfer_safe_workspace: FlashInfer allocated something other than "
                       "the plan; later creations of this call in this process plan at least "
                       "what was observed. Please report this line: %s", audit.report_line())
    except Exception:  # noqa: BLE001 - logging must not hurt the host
        pass


def floor_for(identity) -> int:
    """The most held bytes an audit observed for ``identity`` in this process (0: none)."""
    try:
        return int(_floors.get(identity, 0))
    except TypeError:  # unhashable identity
        return 0


def apply_floor(plan, identity):
    """``plan`` with one extra held "audit-observed" allocation when an earlier audit of
    ``identity`` observed more held bytes than the plan's observable allocations hold.

    Note: the extra allocation changes ``plan.digest()``; digest the plan before this."""
    try:
        floor = floor_for(identity)
        if not floor or not isinstance(plan, Plan):
            return plan
        planned = _held(_expected(plan, set(OBSERVED_APIS)))
        if floor <= planned:
            return plan
        extra = Allocation("audit-observed", floor - planned, "cuMemCreate",
                           plan.handle_type if plan.handle_type in ("posix", "fabric")
                           else "posix", True,
                           f"observed {floor} B held - planned {planned} B (earlier audit)")
        return dataclasses.replace(plan, allocations=plan.allocations + (extra,),
                                   notes=plan.notes + ("raised to what an earlier creation of "
                                                       "this call was observed to allocate",))
    except Exception:  # noqa: BLE001
        return plan


def last() -> Optional[Audit]:
    """The last audit of this process (for ``doctor``)."""
    return _last


def reset() -> None:
    """Forget floors, the last audit and the warning (tests; ``install()``)."""
    global _last, _warned
    with _lock:
        _floors.clear()
        _last = None
        _warned = False


# --------------------------------------------------------------------------- helpers


def _expected(plan, apis) -> list:
    """The plan's allocations an audit can observe, as (api, bytes, held)."""
    if not isinstance(plan, Plan):
        return []
    names = {a.name for a in plan.allocations}
    out = []
    for a in plan.allocations:
        if a.api == "cuMemCreate" and a.name + ".buffer_ptrs" in names:
            api = "torch-symm"  # torch's symmetric memory makes this block
        elif a.api in ("cuMemCreate", "cuMemAlloc", "cudaMalloc"):
            api = a.api
        else:
            continue  # torch tensors and torch's own pointer arrays: not observed
        if a.name == "audit-observed":
            continue
        if api in apis:
            out.append((api, int(a.bytes), bool(a.held)))
    return out


def _held(items) -> int:
    return sum(n for _, n, held in items if held)


def _signal_pad() -> int:
    """The installed torch's symmetric-memory signal pad (2048 where it cannot say)."""
    global _pad
    if _pad is None:
        symm = sys.modules.get(_SYMM_MODULE)
        if symm is None:
            return _FALLBACK_PAD  # not imported: FlashInfer makes no symmetric block
        try:
            _pad = int(symm.get_signal_pad_size())
        except Exception:  # noqa: BLE001 - a torch without the query
            _pad = _FALLBACK_PAD
    return _pad


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


def _torch_version() -> str:
    return str(getattr(sys.modules.get("torch"), "__version__", "-"))


def _describe(request) -> str:
    if request is None:
        return "-"
    if not dataclasses.is_dataclass(request):
        return repr(request)[:300]
    parts = []
    for f in dataclasses.fields(request):
        if not f.compare:
            continue
        value = getattr(request, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        parts.append(f"{f.name}={value}")
    return "(" + ",".join(parts) + ")"


def _fmt(items) -> str:
    counts = collections.Counter(items)
    return "[" + ",".join(f"{api}:{n}{'' if held else '(released)'}" + (f"x{c}" if c > 1 else "")
                          for (api, n, held), c in sorted(counts.items())) + "]"
