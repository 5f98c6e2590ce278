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
  bytes S are observed; the block torch's CUDA allocator makes for it is taken as
  RU(RU(S, 16) + P, G) with P the *installed* torch's ``get_signal_pad_size()``.
  torch allocates that block in C++, out of sight: a wrong granularity in the plan,
  or a torch that allocates more than this formula, would go unseen. So on these
  paths a creation whose observed requests match the plan is ``skipped`` ("cannot
  audit torch's own blocks"), never ``ok``; a request that differs (FlashInfer asked
  torch for other bytes, or the installed pad differs from the plan's) is ``mismatch``.

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
import logging
import os
import sys
import threading
import time
from typing import Optional

from .intercept import Recorder
from ..planning.plan import DEFAULT_GRANULARITY, FALLBACK_TORCH_SIGNAL_PAD, Allocation, Plan

logger = logging.getLogger("flashinfer_safe_workspace")

OBSERVED_APIS = ("cuMemCreate", "cuMemAlloc", "cudaMalloc", "torch-symm")
UNSEEN_TORCH_BLOCKS = ("torch symmetric memory (allocator C/D) allocates its blocks in C++, "
                       "out of sight: the requests matched the plan, the blocks cannot be "
                       "audited")


_lock = threading.Lock()
_busy = False  # one audit patched in at a time per process
_floors: dict = {}  # identity -> most held bytes observed for that call
_last: Optional["Audit"] = None
_warned = False


class Audit(Recorder):
    """One creation's audit. ``status``: "ok" | "mismatch" | "skipped" | "raised"."""

    def __init__(self, plan, request, version, identity, granularity):
        self.plan, self.request, self.version, self.identity = plan, request, version, identity
        self.granularity = int(granularity or DEFAULT_GRANULARITY)
        self.status = "skipped"
        self.reason = "not run"
        self.seen: list = []
        self.apis: set = set()  # what could be observed on this call
        self.signal_pad = FALLBACK_TORCH_SIGNAL_PAD
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
        if extra or missing:
            self.status, self.reason = "mismatch", "allocations differ from the plan"
        elif any(s.api == "torch-symm" for s in self.seen):
            self.status, self.reason = "skipped", UNSEEN_TORCH_BLOCKS
        else:
            self.status, self.reason = "ok", ""


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
    """The installed torch's symmetric-memory signal pad (the one source: ``_facts``)."""
    from ..planning import facts as _facts

    return _facts.signal_pad()[0]


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
