"""Modes 7, 8, 9 (opt-in, DEEP_PROBE): export one granule with FlashInfer's handle type,
import every same-host peer's through the c10d store.

Every rank that decides publishes either its exported handle or ``skip`` (a rank whose
own checks failed), so nobody waits for a rank that will not export. Bounded by half of
what is left of the vote timeout; the export is kept until every peer has said it is
done importing (or the bound ends), then released on every path. The result is this
rank's answer: a failed import names the peer. The last rank through deletes the
round's store keys; a round cut short by its bound, or where no rank took part, leaves
its few small keys behind (one set per such call)."""

from __future__ import annotations

import json
import threading
import time

from .. import _reasons as R
from ..agreement import store as _store
from ..planning import probe as _probe
from .base import fail, handle_of, ok

NAME = "deep"
CODE = R.DEEP_PROBE_FAILED
MODES = (7, 8, 9)
RELEASES = "opt-in; cuMem paths with POSIX fd or FABRIC handles (B1–B4)"
POLL_S = 0.005


def applies(ctx) -> bool:
    return (bool(getattr(ctx.settings, "deep_probe", False)) and ctx.members.kind == "store"
            and handle_of(ctx) in ("posix", "fabric", "vote"))


def _handle(ctx) -> str:
    h = handle_of(ctx)
    return "posix" if h == "vote" else h  # 0.7.4 on one host ends on POSIX without IMEX


_counts: dict = {}  # (ranks, call) -> deep probes run: the same count on every rank
_count_lock = threading.Lock()


def _base_key(ctx) -> str:
    from ..agreement.vote import members_key
    from ..planning.request import identity

    call = identity(ctx.req)
    with _count_lock:
        n = _counts.get((ctx.members.ranks, call), 0)
        _counts[(ctx.members.ranks, call)] = n + 1
    return f"fiws-deep/{members_key(ctx.members.ranks)}/{call}/{n}"


class _Keys:
    def __init__(self, ctx):
        base = _base_key(ctx)
        self.base, self.ranks, self.me = base, ctx.members.ranks, ctx.members.me

    def handle(self, pos):
        return f"{self.base}/h/{pos}"

    def done(self, pos):
        return f"{self.base}/d/{pos}"

    @property
    def count(self):
        return f"{self.base}/n"

    def every(self) -> list:
        n = len(self.ranks)
        return [self.handle(p) for p in range(n)] + [self.done(p) for p in range(n)] + [self.count]


_last_keys: tuple = ()  # the store keys of this process's last deep probe (for tests)


def keys_of_last_run() -> tuple:
    """The store keys the last deep probe of this process used (all deleted once every
    rank taking part is through)."""
    return _last_keys


def _clean_up(line, keys, takers: int, deadline) -> None:
    """Count this rank through; the last of the ``takers`` deletes every key of the round
    (every handle, skips included, was read before anyone counts). Best effort, bounded."""
    try:
        if line.call(lambda st: st.add(keys.count, 1), deadline) >= takers:
            line.call(lambda st: [st.delete_key(k) for k in keys.every()], deadline)
    except Exception:  # noqa: BLE001 - a leftover key costs a few bytes, never a veto
        pass


def _wait_all(line, keys, deadline) -> dict:
    """{key: value} once every key exists, polling (bounded by ``deadline``)."""
    while True:
        if line.call(lambda st: st.check(keys), deadline):
            values = line.call(lambda st: st.multi_get(keys), deadline)
            return dict(zip(keys, values))
        if time.monotonic() >= deadline:
            raise TimeoutError("peers did not publish in time")
        time.sleep(POLL_S)


def run(ctx, take_part: bool):
    """The deep probe for this rank; ``take_part`` False publishes ``skip`` only."""
    global _last_keys
    line = _store.line(ctx.settings.vote_timeout)
    deadline = time.monotonic() + max(ctx.extra.get("left_s", 1.0) / 2, 0.05)
    keys = _Keys(ctx)
    _last_keys = tuple(keys.every())
    prober = _probe.get_prober()
    handle = _handle(ctx) if take_part else "-"
    keep, token = None, {"skip": True}
    try:
        if take_part:
            try:
                token, keep = prober.export_handle(handle)
            except Exception as exc:  # noqa: BLE001 - this rank cannot export
                token = {"skip": True, "error": f"{type(exc).__name__}: {exc}"[:200]}
        token = dict(token, host=ctx.facts().host if ctx.rank is not None else "?")
        me = keys.handle(keys.me)
        line.call(lambda st: st.set(me, json.dumps(token)), deadline)
        if not take_part:
            return None
        if token.get("error"):
            return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", f"export failed: {token['error']}")
        peers = [p for p in range(len(keys.ranks)) if p != keys.me]
        got = _wait_all(line, [keys.handle(p) for p in peers], deadline)
        failed = []
        for pos in peers:
            theirs = json.loads(got[keys.handle(pos)])
            if theirs.get("skip") or theirs.get("host") != token["host"]:
                continue  # not taking part, or another host (mode 6's check)
            try:
                prober.import_handle(handle, theirs)
            except Exception as exc:  # noqa: BLE001
                failed.append(f"from rank {keys.ranks[pos]}: {type(exc).__name__}: {exc}"[:160])
        mine_done = keys.done(keys.me)
        line.call(lambda st: st.set(mine_done, "1"), deadline)
        takers = [p for p in peers if not json.loads(got[keys.handle(p)]).get("skip")]
        _wait_all(line, [keys.done(p) for p in takers], deadline)
        _clean_up(line, keys, len(takers) + 1, deadline)
        if failed:
            return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", "import failed " + "; ".join(failed))
        return ok(f"handle={handle}")
    except (TimeoutError, _store.StoreTimeout) as exc:
        return fail(R.DEEP_PROBE_FAILED, f"handle={handle}", f"round trip not done in time: {exc}")
    finally:
        if keep is not None:
            prober.release_export(keep)
