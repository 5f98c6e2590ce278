"""The wrapper around FlashInfer's creation functions.

It calls the original at most once, returns its result and lets its exceptions
through untouched. Our own work is guarded: the only exception of ours that can
reach the caller is ``WorkspaceVetoed`` (raise mode, or the legacy tuple API).
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
import time

from .audit import compare as _audit
from . import _caller, _config, _decide, _log, _reasons, _veto
from ._errors import WorkspaceVetoed
from ._log import internal_error, logger, rank_tag

# set while FlashInfer's own creation runs: the unified API calls the (wrapped) legacy
# function internally, and that inner call must go straight through.
_inside = contextvars.ContextVar("flashinfer_safe_workspace_inside", default=False)


def make_wrapper(entry: str):
    """A wrapt wrapper function for ``entry`` ("unified" or "legacy")."""

    def wrapper(wrapped, instance, args, kwargs):
        if _inside.get():
            return wrapped(*args, **kwargs)
        settings = _config.current()
        try:
            hit, fast = _decide.cached_veto(entry, wrapped, args, kwargs)
        except Exception:  # noqa: BLE001 - e.g. an argument whose __eq__ raises
            hit = fast = None
        if hit is not None:  # this exact call was vetoed by a decided round
            return _refuse(entry, settings, hit)
        try:
            decision = _decide.decide(entry, wrapped, args, kwargs, settings, fast)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: fail closed (or open)
            internal_error("decide", exc)
            if settings.fail_open:
                decision = _decide.Decision("call", "internal error; fail-open")
            else:
                decision = _decide.Decision("veto", "internal error", _veto.local(
                    f"internal error in flashinfer_safe_workspace: {type(exc).__name__}: {exc}",
                    (_reasons.INTERNAL_ERROR,)), logged=True)
        if decision.action == "veto":
            return _refuse(entry, settings, decision.veto, decision)
        token = _inside.set(True)
        audit = _watch(decision)
        try:
            with audit:
                if settings.create_timeout > 0:
                    with _Watchdog(settings, decision, entry):
                        return wrapped(*args, **kwargs)
                return wrapped(*args, **kwargs)
        finally:
            _inside.reset(token)
            if decision.logged:
                status = getattr(audit, "status", "-") or "-"
                _log.decision(decision, "pass", "create", "-", status)
                _audit.warn_once(audit) if status == "mismatch" else None

    return wrapper


class _NoAudit:
    status = "-"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _watch(decision):
    """The self-audit of FlashInfer's own creation (a real plan only); never raises."""
    if not decision.logged or decision.plan is None:
        return _NoAudit()
    try:
        return _audit.watch(decision.plan, decision.request, decision.version,
                            identity=decision.identity, granularity=decision.granularity)
    except Exception as exc:  # noqa: BLE001
        internal_error("audit.watch", exc)
        return _NoAudit()


def _refuse(entry: str, settings, info, decision=None):
    """What the caller gets on a veto: ``None`` or ``WorkspaceVetoed``, as
    ``_caller.resolve`` answers for ``ON_VETO`` and the calling frame (the legacy
    tuple-returning function always raises)."""
    logged = decision is not None and decision.logged
    debug = not logged and logger.isEnabledFor(logging.DEBUG)
    # the calling module matters to the answer under ON_VETO=auto, else only to a log line
    answer = _caller.resolve(settings.on_veto, entry, need_caller=logged or debug)  # never raises
    if logged:
        fields = _log.decision(decision, "veto", answer.kind, answer.caller, "-")
        _log.veto(info, _veto.headline(info, _then(entry, answer)), answer, fields)
    elif debug:
        logger.debug("fiws decision %s outcome=veto-cached entry=%s %s", rank_tag(), entry,
                     _caller.fields(answer))
    if answer.kind == "raise":
        raise WorkspaceVetoed(info.message, ranks=info.ranks, details=info.details,
                              reasons=info.reasons)
    return None


def _then(entry: str, answer) -> str:
    """What every rank now does, for the veto's first sentence ("" : the non-fused path,
    which is what ``None`` and an engine's caught ``WorkspaceVetoed`` lead to)."""
    if entry == "legacy":
        return "the call raises WorkspaceVetoed (the legacy entry always raises)"
    if answer.kind == "raise" and not answer.why.startswith("auto:"):
        return f"the call raises WorkspaceVetoed ({answer.why})"
    return ""


class _Watchdog:
    """Bounds FlashInfer's own creation call after a yes vote (CREATE_TIMEOUT)."""

    def __init__(self, settings, decision, entry):
        self.settings, self.decision, self.entry = settings, decision, entry
        self.done = threading.Event()
        self.start = 0.0

    def __enter__(self):
        self.start = time.monotonic()
        threading.Thread(target=self._watch, name="fiws-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        return False

    def _watch(self):
        if self.done.wait(self.settings.create_timeout):
            return
        try:
            plan = self.decision.plan
            what = (f"FlashInfer {self.entry} workspace creation (backend "
                    f"{plan.backend if plan else '?'}, plan {plan.peak_bytes if plan else -1} "
                    f"bytes) still running after {time.monotonic() - self.start:.1f} s; ranks "
                    f"that voted yes: {list(self.decision.voted)}. It is probably waiting in a "
                    "collective for a peer that failed after the vote.")
            if self.settings.on_hang == "abort":
                msg = f"flashinfer_safe_workspace {rank_tag()}: {what} Aborting (ON_HANG=abort).\n"
                logger.critical(msg.strip())
                try:
                    sys.stderr.write(msg)
                    sys.stderr.flush()
                finally:
                    os._exit(70)
            logger.error("flashinfer_safe_workspace %s: %s", rank_tag(), what)
        except Exception as exc:  # never let the watchdog thread crash loudly
            internal_error("watchdog", exc)
