"""Logging: one named logger, no handler unless debug is asked for, rank and pid in lines."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import traceback

from . import _reasons

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
    if first:  # the record names its site, for tests' strict mode (tests/strict.py)
        logger.warning("flashinfer_safe_workspace %s: internal error in %s: %s: %s",
                       rank_tag(), site, type(exc).__name__, exc,
                       extra={"fiws_internal_error": site})
    logger.debug("traceback for %s:\n%s", site,
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


# --------------------------------------------------------------------------- the decision line
#
# One INFO line per decision per rank, stable for grepping; ``DECISION_LINE`` parses it (the
# docs/logs.md documents every field; tests/ranks/test_logs.py checks its example against it).

DECISION_FIELDS = ("rank", "pid", "outcome", "entry", "backend", "ranks", "device", "plan_bytes",
                   "free_bytes", "headroom_bytes", "headroom", "probe", "answer", "caller",
                   "audit", "elapsed_ms", "reasons", "check")

DECISION_LINE = re.compile(
    r"fiws decision rank=(?P<rank>-|\d+) pid=(?P<pid>\d+) outcome=(?P<outcome>pass|veto)"
    r" entry=(?P<entry>unified|legacy) backend=(?P<backend>[a-z-]+)"
    r" ranks=(?P<ranks>-|\d+(?:,\d+)*) device=(?P<device>cuda:\d+|-)"
    r" plan_bytes=(?P<plan_bytes>-?\d+) free_bytes=(?P<free_bytes>-?\d+)"
    r" headroom_bytes=(?P<headroom_bytes>-?\d+) headroom=(?P<headroom>[a-z-]+)"
    r" probe=(?P<probe>ok|no|-) answer=(?P<answer>create|none|raise)"
    r" caller=(?P<caller>[A-Za-z0-9_.<>-]+) audit=(?P<audit>ok|mismatch|skipped|raised|-)"
    r" elapsed_ms=(?P<elapsed_ms>\d+\.\d+) reasons=(?P<reasons>-|[A-Z_]+(?:,[A-Z_]+)*)"
    r" check=(?P<check>[a-z-]+)$")


def format_decision(**f) -> str:
    return ("fiws decision rank={rank} pid={pid} outcome={outcome} entry={entry} backend={backend} "
            "ranks={ranks} device={device} plan_bytes={plan_bytes} free_bytes={free_bytes} "
            "headroom_bytes={headroom_bytes} headroom={headroom} probe={probe} answer={answer} "
            "caller={caller} audit={audit} elapsed_ms={elapsed_ms:.1f} reasons={reasons} "
            "check={check}").format(**f)


def decision(d, outcome: str, answer: str, caller: str, audit: str) -> None:
    """Log the decision line of ``d`` (a ``_decide.Decision``). Never raises."""
    try:
        plan, req = d.plan, d.request
        backend = plan.backend if plan is not None else getattr(req, "backend", "-")
        ranks = ",".join(map(str, d.members.ranks)) if d.members is not None else "-"
        codes = d.veto.reasons if outcome == "veto" and d.veto is not None else ()
        line = format_decision(
            rank=rank_tag().split()[0].split("=")[1], pid=os.getpid(), outcome=outcome,
            entry=getattr(req, "entry", "unified"), backend=backend or "-", ranks=ranks,
            device=f"cuda:{d.device}" if d.device >= 0 else "-",
            plan_bytes=plan.peak_bytes if plan is not None else -1, free_bytes=d.free_bytes,
            headroom_bytes=d.headroom_bytes, headroom=d.headroom_why or "-",
            probe="-" if d.probe_ok is None else ("ok" if d.probe_ok else "no"),
            answer=answer, caller=caller or "-", audit=audit, elapsed_ms=d.elapsed_ms,
            reasons=",".join(_reasons.names(codes)) or "-",
            check=getattr(d, "check", "") or "-")
        logger.info(line)
    except Exception as exc:  # noqa: BLE001 - a log line must never fail the call
        internal_error("log.decision", exc)


def parse_decision_lines(text: str) -> list:
    """Every decision line in ``text`` as a dict with typed values."""
    out = []
    for raw in text.splitlines():
        match = DECISION_LINE.search(raw.rstrip())
        if match is None:
            continue
        d = match.groupdict()
        d["rank"] = None if d["rank"] == "-" else int(d["rank"])
        d["ranks"] = [] if d["ranks"] == "-" else [int(x) for x in d["ranks"].split(",")]
        for key in ("pid", "plan_bytes", "free_bytes", "headroom_bytes"):
            d[key] = int(d[key])
        d["elapsed_ms"] = float(d["elapsed_ms"])
        d["reasons"] = [] if d["reasons"] == "-" else d["reasons"].split(",")
        out.append(d)
    return out
