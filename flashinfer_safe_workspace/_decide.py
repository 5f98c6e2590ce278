"""Decide one creation call: arguments -> rank set -> plan and probe -> one round -> answer.

The flow only; the pieces live elsewhere: the call's arguments (``_request``), the ranks
(``_group``), this rank's record under the call's deadline (``_local``: facts, checks,
plan and probe), the round and its register (``agreement``), the veto messages (``_veto``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Optional

from .agreement import (
    allgather as _allgather,
    driver as _driver,
    group as _group,
    positions as _positions,
    store as _store,
    vote as _vote,
)
from . import _config
from .planning import request as _request
from . import _reasons as R
from ._veto import VetoInfo
from .agreement.record import ABORT, PASS, Register
from . import _local, _veto, checks as _checks
from ._log import internal_error
from .planning.plan import Plan

UNIFIED, LEGACY = _request.UNIFIED, _request.LEGACY

_veto_cache: dict = {}  # (entry, ranks, group kind, identity) -> VetoInfo, from decided rounds
_fast: dict = {}  # exact hashable call -> the workspace key above
_posts: dict = {}  # workspace key -> (this rank's position in the set, the abort it posts)
_cache_lock = threading.Lock()


@dataclasses.dataclass
class Decision:
    """What the wrapper does: ``call`` the original, or ``veto``."""

    action: str  # "call" | "veto"
    reason: str = ""
    veto: Optional[VetoInfo] = None
    plan: Optional[Plan] = None
    members: Optional[_group.Members] = None
    request: object = None
    identity: str = ""
    free_bytes: int = -1
    device: int = -1
    headroom_bytes: int = 0
    headroom_why: str = "-"
    probe_ok: Optional[bool] = None
    elapsed_ms: float = 0.0
    logged: bool = False  # a decision line is due (a real round or local decision ran)
    version: Optional[str] = None
    granularity: Optional[int] = None
    cached: bool = False
    check: str = ""  # the failing check's name on a veto ("-": none named)

    @property
    def voted(self) -> tuple:
        return self.members.ranks if self.members is not None else ()


# --------------------------------------------------------------------------- cache


def cached_veto(entry: str, original: Callable, args: tuple, kwargs: dict):
    """A veto this call already got from a decided round, or None. The exact-call key is
    tried first (microseconds); then the workspace key (entry, ranks, group kind, identity), which does
    not depend on per-call objects such as a fresh comm_backend."""
    try:
        fast = (entry, id(original), args, tuple(sorted(kwargs.items())))
        hash(fast)
    except Exception:  # noqa: BLE001 - unhashable (or a hostile __eq__/__hash__)
        fast = None
    if fast is not None:
        wkey = _fast.get(fast)
        if wkey is not None and wkey in _veto_cache:
            _store.check_world()  # a veto of a destroyed default group is forgotten
            hit = _veto_cache.get(wkey)
            if hit is not None:
                _skip(wkey)
                return hit, wkey
    return None, fast


def _skip(wkey) -> None:
    """A call answered without a round still takes its position on the rank set: the i-th
    call is round i on every rank, whatever each rank answers it from. A cached veto also
    posts its abort there (without waiting): a peer that makes another call at that
    position, or did not cache the veto, learns at once instead of at its vote timeout."""
    if wkey[2] != "store":  # (entry, ranks, kind, identity)
        return
    group = _positions.current()
    position = group.skip(_set_key_of(wkey[2], wkey[1]))
    post = _posts.get(wkey)
    if post is not None:
        try:
            _driver.post_skip(wkey[1], post[0], wkey[3], position, post[1],
                              _config.current().vote_timeout, group)
        except Exception as exc:  # noqa: BLE001 - its peers then wait their vote timeout
            internal_error("cache.post", exc)


def _remember(wkey, fast, info: VetoInfo, epoch=None, me=None) -> None:
    """Cache a veto, unless its default group was replaced since (``epoch``; checked under
    the cache's lock, which a replacement's clear takes after bumping the epoch); ``me``:
    this rank's position in a store rank set (its later cached answers post an abort)."""
    post = None
    if me is not None:
        rank = wkey[1][me]
        post = (me, Register(ABORT, rank, f"rank {rank} answered this call from its veto cache",
                             reasons=info.reasons, details=info.details, named=info.ranks,
                             short=info.short, call=wkey[3]).to_text())
    with _cache_lock:
        if epoch is not None and epoch != _store.epoch():
            return
        _veto_cache[wkey] = info
        if post is not None:
            _posts[wkey] = post
        if fast is not None:
            _fast[fast] = wkey


def clear_cache() -> None:
    with _cache_lock:
        _veto_cache.clear()
        _fast.clear()
        _posts.clear()


_store.on_new_world(clear_cache)  # vetoes were decided by the old default group's ranks
_vote.use_comparison(_checks.compare)  # the round runs the cross-rank checks it is handed


def _after_fork_in_child():
    global _cache_lock
    _cache_lock = threading.Lock()
    _set_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- the flow


@dataclasses.dataclass
class _Call:
    """One call being decided: what the round and this rank's record are made from."""

    req: object
    bound: dict
    ident: str
    version: Optional[str]
    members: _group.Members
    settings: _config.Settings
    deadline: float
    start: float
    wkey: tuple
    fast: object = None
    epoch: int = 0  # store.epoch() when the call began
    position: int = -1  # its position on its rank set (store rounds)
    round_key: str = ""  # the store round's key prefix, once opened (the deep probe pairs on it)
    vote: object = None  # the store round, once opened (the deep probe asks it)


def decide(entry: str, original: Callable, args: tuple, kwargs: dict,
           settings: _config.Settings, fast=None) -> Decision:
    """Everything before FlashInfer runs. Our own failures become this rank's "no"."""
    start = time.perf_counter()
    deadline = time.monotonic() + settings.vote_timeout
    req, bound = _request.build(entry, original, args, kwargs)
    if req is None:  # FlashInfer will raise its own TypeError: tell the peers first
        members = _group.guess_members(kwargs)
        if members is not None and members.kind == "store":
            _tell_peers_no(members, _local.unbound_record(members), deadline, settings)
        return Decision("call", "arguments do not bind; FlashInfer reports its own error")
    ident = _request.identity(req)
    try:
        members = _group.members_for(group=bound.get("group"), comm_backend=bound.get("comm_backend"),
                                     uses_comm_backend=_request.uses_comm_backend(req))
    except _group.ForkedChild as exc:  # FlashInfer would wait forever here: never call it
        return Decision("veto", "forked child", _veto.local(str(exc)), logged=True)
    except Exception as exc:  # noqa: BLE001 - e.g. not a member of the group it names
        internal_error("group", exc)
        if settings.fail_open:
            return Decision("call", f"no rank set ({exc}); fail-open")
        return Decision("veto", "no rank set", _veto.local(
            f"could not tell which ranks create this workspace: {type(exc).__name__}: {exc}"),
            logged=True)
    wkey = (entry, members.ranks, members.kind, ident)
    _store.check_world()
    hit = _veto_cache.get(wkey)
    if hit is not None:
        _skip(wkey)
        if fast is not None:
            _remember(wkey, fast, hit)
        return Decision("veto", "cached veto", hit, members=members, request=req, cached=True)
    if members.kind == "local" and _request.needs_process_group(
            req, members.label != _group.NO_PROCESS_GROUP):
        return Decision("call", "torch.distributed is not initialised and no comm_backend is "
                        "given: FlashInfer raises its own error before allocating")
    version = _request.flashinfer_version()
    if _request.unknown_version(version) and settings.unknown_version == "pass-through":
        _local.warn_version(version, settings)
        _skip(wkey)
        return Decision("call", f"FlashInfer {version} not mirrored; pass-through (unprotected)")

    decision = Decision("veto", members=members, request=req, identity=ident, logged=True)
    call = _Call(req, bound, ident, version, members, settings, deadline, start, wkey, fast,
                 _store.epoch())
    if members.kind == "store":  # its position now, its round in position order
        group, key = _positions.current(), _set_key(members)
        call.position = group.take(key)
        try:
            if not group.turn(key, call.position, deadline):
                return _busy(decision, members)
            return _decide_round(decision, call)
        finally:
            group.done(key, call.position)
    lock = _set_lock(members) if members.kind != "local" else None
    if lock is not None and not lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
        return _busy(decision, members)
    try:
        return _decide_round(decision, call)
    finally:
        if lock is not None:
            lock.release()


def _busy(decision: Decision, members) -> Decision:
    info = _veto.local(f"another thread of this process was still deciding for ranks "
                          f"{list(members.ranks)} when the vote timeout ran out")
    decision.veto, decision.reason = info, info.message
    return decision  # not cached: the peers may have decided either way without us


def _run_round(rnd, call: _Call, decision: Decision):
    """``(outcome, record or None)`` of the round; our own failures are an abort."""
    record = None
    try:
        rnd.open()
        if call.members.kind == "store":  # "fiws/<generation>/<ranks>/<position>/": on every rank
            call.round_key, call.vote = rnd.prefix, rnd
        record = _local.record(call, decision, _set_key(call.members))
        return rnd.vote(record), record
    except (_store.StoreTimeout, _store.StoreUnavailable) as exc:
        rnd.abort_now(f"store: {exc}")
        text = str(exc) if str(exc).startswith("the c10d store") else \
            f"the c10d store did not answer: {exc}"
        return _vote.Outcome(False, missing=text, in_doubt=True), record
    except Exception as exc:  # noqa: BLE001 - our bug, or the store surprising us
        internal_error("vote", exc)
        rnd.abort_now(f"internal error: {exc}")
        return _vote.Outcome(False, missing=f"internal error: {type(exc).__name__}: {exc}",
                             in_doubt=True), record
    except BaseException:  # KeyboardInterrupt, SystemExit: abort first, then let it through
        rnd.abort_now("interrupted")
        raise


def _decide_round(decision: Decision, call: _Call) -> Decision:
    rnd = _round_for(call.members, call.ident, call.deadline, call.settings,
                     _request.summary(call.req), call.position)
    outcome, record = _run_round(rnd, call, decision)
    decision.elapsed_ms = (time.perf_counter() - call.start) * 1000
    if outcome.register is not None and outcome.register.outcome == PASS:  # all reject it
        decision.action, decision.logged = "call", False
        decision.reason = "FlashInfer rejects these arguments on every rank"
        return decision
    if outcome.commit:
        decision.action, decision.reason = "call", "every rank voted yes"
        return decision
    decision.check = ((outcome.register.check if outcome.register is not None else "")
                      or (outcome.verdict.check if outcome.verdict is not None else "")
                      or (record.failed_check() if record is not None else "")
                      or _checks.named_in(outcome.register.why if outcome.register else "")
                      or _checks.named_in(outcome.missing)) or "-"
    info = _veto.veto(outcome, call.members, decision.plan, record)
    decision.veto, decision.reason = info, info.message
    if _keep(outcome, call.members.kind, call.ident):
        _remember(call.wkey, call.fast, info, call.epoch,
                  call.members.me if call.members.kind == "store" else None)
    return decision


def _keep(outcome, kind: str, ident: str = "") -> bool:
    """Whether a veto is cached: a decided register, unless a mismatch decided it (two
    threads may make the same two calls in another order on each rank) or it was written
    for another call than this rank's (the group's calls are out of step). Judged from the
    register, which every rank reads alike, not from this rank's own no. Without one:
    kept for a local decision; for a comm backend only if both exchanges matched."""
    if outcome.in_doubt:
        return False
    reg = outcome.register
    if reg is not None:
        if reg.call and ident and reg.call != ident:
            return False
        return R.ARG_MISMATCH not in reg.reasons
    if kind == "local":
        return True
    verdict = outcome.verdict
    return verdict is not None and not verdict.mismatch and not outcome.missing


def _tell_peers_no(members, record, deadline, settings) -> None:
    """Publish this rank's "no" for a call it cannot decide (bounded; errors are ours), in
    the position this call takes on the set, like every call."""
    group, key = _positions.current(), _set_key(members)
    position = group.take(key)
    try:
        if not group.turn(key, position, deadline):
            return  # the peers time out on this rank's record: a veto there too
        rnd = _round_for(members, record.call, deadline, settings, record.args, position)
        try:
            rnd.open()
            rnd.vote(record)
        except Exception as exc:  # noqa: BLE001
            internal_error("vote.unbound", exc)
            rnd.abort_now("arguments do not bind")
        except BaseException:
            rnd.abort_now("interrupted")
            raise
    finally:
        group.done(key, position)


def _set_key(members) -> str:
    return _set_key_of(members.kind, members.ranks)


def _set_key_of(kind: str, ranks) -> str:
    return kind + ":" + _vote.members_key(ranks)


_set_locks: dict = {}  # set key -> the lock serialising this process's allgather decisions


def _set_lock(members):  # the lock that serialises this process's decisions on a rank set
    with _cache_lock:
        return _set_locks.setdefault(_set_key(members), threading.Lock())


def _round_for(members, ident, deadline, settings, args=None, position=-1):
    if members.kind == "store":
        return _driver.StoreVote(members.ranks, members.me, ident, deadline,
                                 settings.vote_timeout, position, members.label, args)
    if members.kind == "allgather":
        return _allgather.AllgatherRound(members.comm, members.size, members.me, ident, deadline,
                                    members.label)
    return _vote.LocalRound(members.label)
