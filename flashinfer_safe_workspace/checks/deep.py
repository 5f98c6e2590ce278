"""Modes 7, 8, 9 (opt-in, DEEP_PROBE): export one granule with FlashInfer's handle type,
import every same-host peer's.

The check knows facts, not transports: its context brings the round's exchange
(``ctx.extra["exchange"]``, ``checks/exchange``: keyed by the round itself, so the
ranks of one round always pair) and the prober (``ctx.extra["prober"]``). Every rank that
decides publishes either its exported handle or ``skip`` (a rank whose own checks
failed), so nobody waits for a rank that will not export. A rank that arrives after its
round was decided (a peer said no, or gave up waiting) skips the probe: the vote follows
that register. The exchange is bounded by the round (its deadline less the vote's own
time) and ends early once the register is written; the export is kept until every peer
has said it is done importing, then released on every path.

The result is this rank's answer. A failed import is a no, naming the peer. A peer that
never published, or never finished importing, is not this rank's failure: the check says
so without a no (``applies=False``), and the vote names that peer as absent. The last
rank through deletes the exchange's keys; one cut short leaves its few small keys behind."""

from __future__ import annotations

from .. import _reasons as R
from ..agreement.record import CheckResult
from .base import fail, handle_of, ok

NAME = "deep"
CODE = R.DEEP_PROBE_FAILED
MODES = (7, 8, 9)
RELEASES = "opt-in; cuMem paths with POSIX fd or FABRIC handles (B1–B4)"


def applies(ctx) -> bool:
    return (bool(getattr(ctx.settings, "deep_probe", False)) and ctx.members.kind == "store"
            and handle_of(ctx) in ("posix", "fabric", "vote"))


def _handle(ctx) -> str:
    h = handle_of(ctx)
    return "posix" if h == "vote" else h  # 0.7.4 on one host ends on POSIX without IMEX


_last_keys: tuple = ()  # the store keys of this process's last deep probe (for tests)


def keys_of_last_run() -> tuple:
    """The store keys the last deep probe of this process used (all deleted once every
    rank taking part is through)."""
    return _last_keys


def _ranks_at(ex, positions) -> list:
    return [ex.ranks[p] for p in positions]


def _not_run(handle: str, why: str) -> CheckResult:
    """Not this rank's failure: no answer of its own (the vote decides, and names why)."""
    return CheckResult(True, R.DEEP_PROBE_FAILED, f"handle={handle}", f"not run to its end: {why}",
                       applies=False)


def run(ctx, take_part: bool):
    """The deep probe for this rank; ``take_part`` False publishes ``skip`` only."""
    global _last_keys
    ex, prober = ctx.extra.get("exchange"), ctx.extra.get("prober")
    handle = _handle(ctx) if take_part else "-"
    if ex is None or prober is None:  # no round to pair in (not a store round)
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", "no round to exchange handles in")
    if ex.decided():  # late: the round was decided without this rank; the vote follows it
        return _not_run(handle, "the round was decided before this rank's probe")
    _last_keys = ex.keys()
    keep, token = None, {"skip": True}
    try:
        if take_part:
            try:
                token, keep = prober.export_handle(handle)
            except Exception as exc:  # noqa: BLE001 - this rank cannot export
                token = {"skip": True, "error": f"{type(exc).__name__}: {exc}"[:200]}
        token = dict(token, host=ctx.facts().host if ctx.rank is not None else "?")
        ex.publish(token)
        if not take_part:
            return None
        if token.get("error"):
            return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", f"export failed: {token['error']}")
        return _import_all(ex, prober, handle, token)
    finally:
        if keep is not None:
            prober.release_export(keep)


def _import_all(ex, prober, handle: str, token: dict):
    got, missing = ex.gather()
    if missing:
        why = ("the round was decided while it waited" if ex.stopped else
               f"ranks {_ranks_at(ex, missing)} published no handle before the round's bound")
        return _not_run(handle, why)
    failed = []
    for pos, theirs in got.items():
        if theirs.get("skip") or theirs.get("host") != token["host"]:
            continue  # not taking part, or another host (mode 6's check)
        try:
            prober.import_handle(handle, theirs)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"from rank {ex.ranks[pos]}: {type(exc).__name__}: {exc}"[:160])
    ex.done()
    takers = [p for p, theirs in got.items() if not theirs.get("skip")]
    late = ex.wait_done(takers)
    ex.finish(len(takers) + 1)
    if failed:
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", "import failed " + "; ".join(failed))
    if late:
        return _not_run(handle, f"ranks {_ranks_at(ex, late)} did not finish importing before "
                        "the round's bound")
    return ok(f"handle={handle}")
