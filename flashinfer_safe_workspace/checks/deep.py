"""Modes 7, 8, 9 (opt-in, DEEP_PROBE): export one granule with FlashInfer's handle type,
import every same-host peer's.

The check knows facts, not transports: its context brings the round's exchange
(``ctx.extra["exchange"]``, ``agreement/exchange``: keyed by the round itself, so the
ranks of one round always pair) and the prober (``ctx.extra["prober"]``). Every rank that
decides publishes either its exported handle or ``skip`` (a rank whose own checks
failed), so nobody waits for a rank that will not export. Bounded by half of what is left
of the vote timeout; the export is kept until every peer has said it is done importing
(or the bound ends), then released on every path. The result is this rank's answer: a
failed import names the peer, a peer that never published is named as such. The last
rank through deletes the exchange's keys; one cut short by its bound leaves its few small
keys behind."""

from __future__ import annotations

import time

from .. import _reasons as R
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


def run(ctx, take_part: bool):
    """The deep probe for this rank; ``take_part`` False publishes ``skip`` only."""
    global _last_keys
    ex, prober = ctx.extra.get("exchange"), ctx.extra.get("prober")
    handle = _handle(ctx) if take_part else "-"
    if ex is None or prober is None:  # no round to pair in (not a store round)
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", "no round to exchange handles in")
    deadline = time.monotonic() + max(ctx.extra.get("left_s", 1.0) / 2, 0.05)
    _last_keys = ex.keys()
    keep, token = None, {"skip": True}
    try:
        if take_part:
            try:
                token, keep = prober.export_handle(handle)
            except Exception as exc:  # noqa: BLE001 - this rank cannot export
                token = {"skip": True, "error": f"{type(exc).__name__}: {exc}"[:200]}
        token = dict(token, host=ctx.facts().host if ctx.rank is not None else "?")
        ex.publish(token, deadline)
        if not take_part:
            return None
        if token.get("error"):
            return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", f"export failed: {token['error']}")
        return _import_all(ex, prober, handle, token, deadline)
    finally:
        if keep is not None:
            prober.release_export(keep)


def _import_all(ex, prober, handle: str, token: dict, deadline: float):
    got, missing = ex.gather(deadline)
    if missing:
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}",
                    f"ranks {_ranks_at(ex, missing)} published no handle in this round's deep "
                    "probe before its bound (half the time left)")
    failed = []
    for pos, theirs in got.items():
        if theirs.get("skip") or theirs.get("host") != token["host"]:
            continue  # not taking part, or another host (mode 6's check)
        try:
            prober.import_handle(handle, theirs)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"from rank {ex.ranks[pos]}: {type(exc).__name__}: {exc}"[:160])
    ex.done(deadline)
    takers = [p for p, theirs in got.items() if not theirs.get("skip")]
    late = ex.wait_done(takers, deadline)
    ex.finish(len(takers) + 1, deadline)
    if failed:
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", "import failed " + "; ".join(failed))
    if late:
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}",
                    f"ranks {_ranks_at(ex, late)} did not finish importing before the bound")
    return ok(f"handle={handle}")
