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


# --------------------------------------------------------------------------- extra= fields
#
# The decision record and the veto WARNING also carry their fields on the LogRecord
# (``extra=``), so that a JSON formatter emits them as fields. Each name is ``fiws_`` and a
# decision-line field (``fiws_outcome``, ``fiws_reasons``...), with the typed value
# ``parse_decision_lines`` reads from the line; ``fiws_event`` says which record it is. The
# prefix keeps them clear of LogRecord's own attributes (docs/logs.md lists them).

EXTRA_PREFIX = "fiws_"
VETO_PAGE = "docs/when-it-vetoes.md"  # every veto WARNING ends by naming it


def decision_fields(d, outcome: str, answer: str, caller: str, audit: str) -> dict:
    """The decision line's fields of ``d`` (a ``_decide.Decision``), typed as
    ``parse_decision_lines`` returns them."""
    plan, req = d.plan, d.request
    backend = plan.backend if plan is not None else getattr(req, "backend", "-")
    codes = d.veto.reasons if outcome == "veto" and d.veto is not None else ()
    rank = rank_tag().split()[0].split("=")[1]
    return {
        "rank": None if rank == "-" else int(rank), "pid": os.getpid(), "outcome": outcome,
        "entry": getattr(req, "entry", "unified"), "backend": backend or "-",
        "ranks": list(d.members.ranks) if d.members is not None else [],
        "device": f"cuda:{d.device}" if d.device >= 0 else "-",
        "plan_bytes": plan.peak_bytes if plan is not None else -1, "free_bytes": d.free_bytes,
        "headroom_bytes": d.headroom_bytes, "headroom": d.headroom_why or "-",
        "probe": "-" if d.probe_ok is None else ("ok" if d.probe_ok else "no"),
        "answer": answer, "caller": caller or "-", "audit": audit,
        "elapsed_ms": float(f"{d.elapsed_ms:.1f}"), "reasons": list(_reasons.names(codes)),
        "check": getattr(d, "check", "") or "-"}


def line_of(fields: dict) -> str:
    """The decision line of ``decision_fields``' dict."""
    return format_decision(**dict(
        fields, rank="-" if fields["rank"] is None else fields["rank"],
        ranks=",".join(map(str, fields["ranks"])) or "-",
        reasons=",".join(fields["reasons"]) or "-"))


def extra(event: str, fields: dict, **more) -> dict:
    """``extra=`` of a record: ``fiws_event`` and every field, prefixed."""
    out = {EXTRA_PREFIX + "event": event}
    for key, value in {**fields, **more}.items():
        out[EXTRA_PREFIX + key] = value
    return out


def decision(d, outcome: str, answer: str, caller: str, audit: str) -> dict:
    """Log the decision line of ``d`` (a ``_decide.Decision``), its fields on the record
    too; returns them (``{}`` if that failed). Never raises."""
    try:
        fields = decision_fields(d, outcome, answer, caller, audit)
        logger.info(line_of(fields), extra=extra("decision", fields))
        return fields
    except Exception as exc:  # noqa: BLE001 - a log line must never fail the call
        internal_error("log.decision", exc)
        return {}


def veto(info, summary: str, answer, fields: dict) -> None:
    """The veto WARNING: ``summary`` (``_veto.headline``) first, then this
    rank's fields, then the veto's message, then the page that says what to do. The
    decision's fields ride on the record, with the sentence and the message. Never raises."""
    try:
        reasons = ",".join(_reasons.names(info.reasons)) or "-"
        message = info.message.rstrip()
        text = (f"flashinfer_safe_workspace: {summary} Fields: {rank_tag()} "
                f"answer={answer.kind} caller={answer.caller} reasons={reasons} "
                f"check={fields.get('check', '-')} ({answer.why}). Detail: {message}"
                f"{'' if message.endswith('.') else '.'} What to do: {VETO_PAGE}")
        logger.warning("%s", text, extra=extra(
            "veto", fields, summary=summary, message=info.message, named=list(info.ranks),
            answer_why=answer.why, help=VETO_PAGE))
    except Exception as exc:  # noqa: BLE001 - the plain message, if ours failed
        internal_error("log.veto", exc)
        logger.warning("flashinfer_safe_workspace %s: vetoed: %s What to do: %s", rank_tag(),
                       getattr(info, "message", "-"), VETO_PAGE)


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
