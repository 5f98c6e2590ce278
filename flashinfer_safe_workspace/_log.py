"""Logging: one named logger, no handler unless debug is asked for, rank and pid in lines."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

logger = logging.getLogger("flashinfer_safe_workspace")

_handler: logging.Handler | None = None
_once: set[str] = set()
_once_lock = threading.Lock()


def configure(debug: bool) -> None:
    """With debug on, attach one stderr handler (only if the logger has none)."""
    global _handler
    if not debug:
        return
    logger.setLevel(logging.DEBUG)
    if logger.handlers:
        return
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[flashinfer_safe_workspace pid=%(process)d] %(levelname)s %(message)s"))
    logger.addHandler(_handler)


def rank_tag() -> str:
    """``rank=R pid=P`` for the global torch.distributed rank (``-`` when unknown)."""
    rank = "-"
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = str(dist.get_rank())
    except Exception:  # noqa: BLE001 - a log tag must never fail
        pass
    return f"rank={rank} pid={os.getpid()}"


def internal_error(site: str, exc: BaseException) -> None:
    """Log an error in our own code: one warning per site, the traceback at debug."""
    with _once_lock:
        first = site not in _once
        _once.add(site)
    if first:
        logger.warning("flashinfer_safe_workspace %s: internal error in %s: %s: %s",
                       rank_tag(), site, type(exc).__name__, exc)
    logger.debug("traceback for %s:\n%s", site,
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
