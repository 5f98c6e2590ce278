"""The fault matrix: scenarios run as real multi-process gloo groups on the simulated device.

Shared by tests/ranks/test_faults.py (asserts) and scripts/reliability-matrix (writes
docs/reliability.md). Each scenario: ranks run ``body`` (with rank_lib helpers); every rank
reports its outcome, time to return, whether FlashInfer created a workspace on it, the
simulated bytes still held, and (where every rank is alive) whether the host's own
``all_reduce`` on WORLD still works afterwards.

The promise checked everywhere: created on every rank that called or on none, every rank
back within ``bound(T)`` (1.5 vote timeouts + 2 s), nothing held.

No scenario relies on a sleep landing inside a window: a fault is injected at a named fault
point of the package (``flashinfer_safe_workspace._points``, through ``rank_lib.at``) and the
ranks wait on each other through the store. Two vote timeouts: ``VOTE_TIMEOUT`` (short) where
a rank is meant to wait one out, ``LONG_T`` where none is, so that "at once" (``secs < T``:
the timeout never fired) holds also on a loaded machine and costs nothing when it does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from harness import run_ranks

VOTE_TIMEOUT = 2.0  # seconds: the scenarios where a rank waits the timeout out
LONG_T = 30.0  # the scenarios where no rank should: their "at once" is "before the timeout"


def bound(t: float, timeouts: float = 1.0) -> float:
    """How long a rank may take when it waits out ``timeouts`` vote timeouts of ``t`` s:
    slack that scales with the timeout, plus a little for the calls around it."""
    return timeouts * t * 1.5 + 2.0


BOUND = bound(VOTE_TIMEOUT)  # for the report

COMMON = """
import os, signal, threading
import rank_lib
T = float(os.environ.get("FIWS_T", "3"))
result["t"] = T
STORE = dist.distributed_c10d._get_default_store()
WAIT = datetime.timedelta(seconds=60)  # every wait of a scenario on its peers is bounded
def peer_pid(r):
    return int(STORE.get(f"pid/{r}"))
def mark(name):  # tell the peers this rank has reached ``name``
    STORE.set(f"mark/{name}", "1")
def await_mark(*names):  # wait (bounded) until a peer has reached every ``name``
    STORE.wait([f"mark/{n}" for n in names], WAIT)
STORE.set(f"pid/{RANK}", str(os.getpid()))
"""
COMMON += f"LONG_T = {LONG_T!r}\n"

HOST = """
result["host"] = rank_lib.host_all_reduce_ok()
"""


@dataclasses.dataclass
class Scenario:
    name: str
    world: int
    body: str
    expected: str  # for the report
    check: Callable  # (runs) -> None, raises AssertionError
    env: dict = dataclasses.field(default_factory=dict)
    timeout: float = 60.0
    t: float = LONG_T  # the vote timeout (VOTE_TIMEOUT where a rank waits it out)
    host: bool = True  # every rank alive at the end: check the host's own all_reduce
    reasons: dict = dataclasses.field(default_factory=dict)  # rank -> the veto's reason names
    internal_errors: tuple = ()  # sites where the scenario injects an error into our code

    def verify(self, runs) -> None:
        """``check``, then the reason codes each listed rank's veto gave."""
        self.check(runs)
        for site in self.internal_errors:  # an injected error must have been seen
            _expect(any(site in r["internal_errors"] for r in runs),
                    f"no rank reported the internal error at {site!r} this scenario injects")
        for rank, want in self.reasons.items():
            got = _res(runs, rank).get("reasons")
            options = [list(w) for w in (want if isinstance(want, tuple) else (want,))]
            _expect(got in options, f"rank {rank}: reasons {got}, expected one of {options}")


def told(code: str) -> tuple:
    """A peer of the rank that said no with ``code``: it saw that record (the same code), or
    arrived after the abort was written and followed it (ABORTED)."""
    return ([code], ["ABORTED"])


def _res(runs, rank):
    r = runs[rank]["result"]
    assert r is not None, f"rank {rank} gave no result (rc={runs[rank]['returncode']}):\n{runs[rank]['stderr']}"
    return r


def _expect(cond, what):
    assert cond, what
    return True


def all_or_none(runs, ranks=None, timeouts=1.0):
    """The promise: created on every listed rank or on none; each back within
    ``bound(T, timeouts)``; nothing held; the host's all_reduce still works where it was
    checked."""
    ranks = list(range(len(runs))) if ranks is None else ranks
    rs = [_res(runs, r) for r in ranks]
    created = [r["calls"] > 0 for r in rs]
    _expect(all(created) or not any(created), f"split: {[(r['rank'], r['outcome']) for r in rs]}")
    for r in rs:
        most = bound(r["t"], timeouts)
        _expect(r["secs"] <= most, f"rank {r['rank']} took {r['secs']:.2f} s > {most} s")
        _expect(r.get("live", 0) == 0, f"rank {r['rank']} still holds {r.get('live')} bytes")
        if "host" in r:
            _expect(r["host"] is True, f"rank {r['rank']}: host all_reduce after: {r['host']}")
    return all(created)


def at_once(runs, rank, key="secs"):
    """Rank ``rank`` answered before its vote timeout could have fired (the timeout is
    long where this is asked: a loaded machine does not make it fail)."""
    r = _res(runs, rank)
    return _expect(r[key] < r["t"], f"rank {rank}: {key} {r[key]:.2f} s, not before the "
                   f"{r['t']} s timeout: {r}")


def store_error_is_a_timeout(runs, ranks):
    """A rank whose veto says STORE_ERROR was refused by a store operation that ran out of
    time, not by one that failed at once: only a store host that did not answer says so,
    and a rank finds that out at its deadline + GRACE_S at the earliest (``round.call_store``).
    A store that fails outright while its host is alive would be a bug, and so earlier."""
    from flashinfer_safe_workspace.agreement.vote import GRACE_S

    for rank in ranks:
        r = _res(runs, rank)
        if r.get("reasons") == ["STORE_ERROR"]:
            _expect(r["secs"] >= r["t"] + GRACE_S, f"rank {rank}: STORE_ERROR after "
                    f"{r['secs']:.2f} s, before its store operations could time out "
                    f"({r['t']} s + {GRACE_S} s): {r}")
    return True


def none_on(ranks=None, outcome="none", fast=False, timeouts=1.0):
    """None (or ``outcome``) on every listed rank; ``fast``: each at once."""
    def check(runs):
        created = all_or_none(runs, ranks, timeouts)
        _expect(not created, "expected no workspace")
        for rank in ranks if ranks is not None else range(len(runs)):
            _expect(_res(runs, rank)["outcome"] == outcome, _res(runs, rank))
            if fast:
                at_once(runs, rank)
    return check


def created_on_all(runs):
    _expect(all_or_none(runs), "expected a workspace on every rank")


# the first call of "one rank's arguments rejected by FlashInfer": the backends differ, so
# the calls do: a mismatch, seen in the records or in the register the rank followed
FIRST_OF_REJECTED = told("ARG_MISMATCH")


def _cached_reasons(runs, short: int):
    """The cached-veto scenarios: the 1st call is refused for the short rank's memory on both
    ranks; the 2nd is answered from the cache on the short rank (no decision line: None),
    which posts its cached abort in that round; its peer, making another call there, reads
    it: the cached cause, and a mismatch of calls."""
    peer = 1 - short
    _expect(_res(runs, short)["a_reasons"] == ["OUT_OF_MEMORY"], runs)
    _expect(_res(runs, peer)["a_reasons"] == ["OUT_OF_MEMORY"], runs)
    _expect(_res(runs, short)["b_reasons"] is None, runs)
    _expect(_res(runs, peer)["b_reasons"] == ["ARG_MISMATCH", "OUT_OF_MEMORY"], runs)


def _call(extra="", prelude="", **create):
    args = ", ".join(f"{k}={v}" for k, v in create.items())
    return f"""
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T{extra})
{prelude}
outcome, secs, err = rank_lib.create(rank=RANK{', ' + args if args else ''})
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
"""


def _free(expr="None"):
    return f"FREE = {expr}\n"


SHORT0 = "rank_lib.need_mb() - 2 if RANK == 0 else None"
WATCHDOG_T = 1.0  # CREATE_TIMEOUT of the watchdog scenario


def _aborted_by_the_watchdog(runs):
    """The watchdog ended the process (status 70: a blocked FlashInfer call ends no other
    way before the harness kills it), with its message, after about CREATE_TIMEOUT: the
    time the message gives is within ``bound`` of it."""
    import re

    r = runs[0]
    _expect(r["returncode"] == 70 and r["result"] is None
            and "Aborting (ON_HANG=abort)" in r["stderr"], r)
    found = re.search(r"still running after ([0-9.]+) s", r["stderr"])
    _expect(found is not None and float(found.group(1)) <= bound(WATCHDOG_T), r)


SCENARIOS = [
    Scenario(
        "dead rank before the vote", 2,
        _free() + "if RANK == 1:\n    os._exit(1)\n" + _call(),
        "survivor: None within the bound; FlashInfer not entered",
        none_on([0]), env={"FIWS_LINGER_S": "1"}, host=False, t=VOTE_TIMEOUT,
        reasons={0: ["ABSENT"]}),
    Scenario(
        "rank killed during its probe", 2,
        _free() + _call(prelude="if RANK == 1:\n    dev.probe = lambda *a, **k: os._exit(1)"),
        "survivor: None within the bound",
        none_on([0]), env={"FIWS_LINGER_S": "1"}, host=False, t=VOTE_TIMEOUT,
        reasons={0: ["ABSENT"]}),
    Scenario(
        "late rank (arrives after the timeout)", 2,
        _free() + """
if RANK == 1:  # rank 1's own timeout is long: it must follow the abort, not wait
    T = result["t"] = LONG_T
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T, on_veto="raise")
if RANK == 1:
    await_mark("returned-0")  # arrives once rank 0 has timed out and returned
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 0:
    mark("returned-0")
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "both vetoed; rank 0 names rank 1 as absent; rank 1 follows the decided abort at once",
        lambda runs: (none_on(outcome="vetoed")(runs),
                      _expect("ranks [1] did not answer in time" in _res(runs, 0)["err"], _res(runs, 0)),
                      at_once(runs, 1)),
        t=VOTE_TIMEOUT, reasons={0: ["ABSENT"], 1: ["ABORTED"]}),
    Scenario(
        "rank stopped (SIGSTOP) in the vote, resumed after the timeout", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:  # stopped inside decide, in its probe (before its record); late on resume
    answered, probed = rank_lib.late_probe(dev)
dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 0:  # resumed once rank 0 has returned (its abort written)
    result["stopped"] = rank_lib.wait_stopped(peer_pid(1))
    os.kill(peer_pid(1), signal.SIGCONT)
else:
    answered.set()
    result["probed"] = probed.wait(60)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "both None; rank 0 within the bound; rank 1, its probe stopped past its deadline, "
        "aborts on resume naming the late step (STEP_TIMEOUT)",
        lambda runs: (all_or_none(runs, [0]), all_or_none(runs, [1], timeouts=2),
                      _expect(_res(runs, 0)["stopped"] is True, runs),
                      _expect(_res(runs, 1)["probed"] is True, runs),
                      _expect([_res(runs, r)["outcome"] for r in (0, 1)] == ["none", "none"], runs)),
        # rank 1's own no is the late probe; rank 0's abort is in before rank 1 is resumed:
        # rank 1 follows it, or its store operations find its deadline + GRACE_S passed
        t=VOTE_TIMEOUT, reasons={0: ["ABSENT"], 1: (["ABORTED", "STEP_TIMEOUT"],
                                                    ["STEP_TIMEOUT", "STORE_ERROR"])}),
    Scenario(
        "rank stopped (SIGSTOP) at its deadline before its abort is sent; its peer commits "
        "meanwhile", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:  # at its deadline, its abort about to go: rank 0 stops it there
    rank_lib.at("round.abort_sending", lambda: (mark("aborting-1"), time.sleep(0.5)))
dist.barrier()
if RANK == 0:  # arrives once rank 1 is stopped: it completes the count and commits
    await_mark("aborting-1")
    os.kill(peer_pid(1), signal.SIGSTOP)
    result["stopped"] = rank_lib.wait_stopped(peer_pid(1))
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 0:  # resumed past the grace (1 s): its tick and its abort's reply race
    time.sleep(1.5)
    os.kill(peer_pid(1), signal.SIGCONT)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "both created: the stopped rank's grace runs from when it runs again, so its "
        "abort's reply (the commit) is its answer, never doubt beside its peer's creation "
        "(issue 29's review, F1: a split in 2 of 4 runs before)",
        lambda runs: (_expect(all_or_none(runs, timeouts=2), "expected a workspace on "
                              "every rank"),  # rank 1 is back 1.5 s past its deadline
                      _expect(_res(runs, 0)["stopped"] is True, runs)),
        t=VOTE_TIMEOUT, reasons={0: [], 1: []}),
    Scenario(
        "store host (rank 0) stopped during the vote", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
host = peer_pid(0)  # read before the store stops answering
if RANK == 0:  # stops itself inside its probe (before its record) once rank 1 waits in the
    # vote; late on resume
    answered, probed = rank_lib.late_probe(dev, before=lambda: await_mark("published-1"))
else:  # waits in the vote only once the store is stopped: no operation of its own after
    # publishing can be answered before it has returned
    rank_lib.at("round.published", lambda: (mark("published-1"), rank_lib.wait_stopped(host)))
dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 1:  # resume the store host before reporting (the report's time is taken above)
    result["stopped"] = rank_lib.wait_stopped(host)
    os.kill(host, signal.SIGCONT)
else:  # the late probe ends in the background: nothing may be held once it has
    answered.set()
    result["probed"] = probed.wait(60)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 1 returns None within the bound while the store is stopped (STORE_ERROR); rank 0, "
        "its probe stopped past its deadline, None on resume, naming the late step (STEP_TIMEOUT)",
        lambda runs: (all_or_none(runs, [1]), all_or_none(runs, [0], timeouts=2),
                      _expect(_res(runs, 1)["stopped"] is True, runs),
                      _expect(_res(runs, 0)["probed"] is True, runs),
                      _expect([_res(runs, r)["outcome"] for r in (0, 1)] == ["none", "none"], runs)),
        timeout=90, t=VOTE_TIMEOUT,
        # rank 0's own no is the late probe (STEP_TIMEOUT); how its round ended for it depends
        # on whether its resumed store operations are still inside its deadline + GRACE_S
        # (ranks start apart) and on whether rank 1's queued abort reaches the store first:
        # out of time (STORE_ERROR), rank 1's abort followed (ABORTED), or its own abort won
        reasons={0: (["STEP_TIMEOUT", "STORE_ERROR"], ["ABORTED", "STEP_TIMEOUT"], ["STEP_TIMEOUT"]),
                 1: ["STORE_ERROR"]}),
    Scenario(
        "Ctrl-C (SIGINT) on a rank waiting in the vote; peer arrives later", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 0:
    rank_lib.at("round.published", lambda: mark("published-0"))
else:  # the signal once rank 0 waits in the vote; rank 1's own call once rank 0 has it
    await_mark("published-0")
    result["sent"] = time.monotonic()
    os.kill(peer_pid(0), signal.SIGINT)
    await_mark("interrupted-0")
t0 = time.perf_counter()
try:
    outcome, secs, err = rank_lib.create(rank=RANK)
except KeyboardInterrupt:
    outcome, secs, err = "interrupted", time.perf_counter() - t0, ""
    result["caught"] = time.monotonic()
    mark("interrupted-0")
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 0: KeyboardInterrupt before its timeout could fire, abort written first; rank 1 (later): None at once",
        lambda runs: (all_or_none(runs),
                      _expect(_res(runs, 0)["outcome"] == "interrupted", _res(runs, 0)),
                      _expect(_res(runs, 0)["caught"] - _res(runs, 1)["sent"] < _res(runs, 0)["t"],
                              (_res(runs, 0), _res(runs, 1))),
                      _expect(_res(runs, 1)["outcome"] == "none", _res(runs, 1)), at_once(runs, 1)),
        reasons={1: ["ABORTED"]}),
    Scenario(
        "KeyboardInterrupt during the probe", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:
    dev.interrupt_after = 1
try:
    outcome, secs, err = rank_lib.create(rank=RANK)
except KeyboardInterrupt:
    outcome, secs, err = "interrupted", 0.0, ""
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 1: interrupt propagates, nothing held, abort written; rank 0: None at once (not at the timeout)",
        lambda runs: (all_or_none(runs),
                      _expect(_res(runs, 1)["outcome"] == "interrupted", _res(runs, 1)),
                      _expect(_res(runs, 0)["outcome"] == "none", _res(runs, 0)), at_once(runs, 0)),
        reasons={0: ["ABORTED"]}),
    Scenario(
        "probe exception on one rank (fail-closed)", 2,
        _free() + _call(prelude="if RANK == 1:\n    dev.error = RuntimeError('driver exploded')"),
        "both None, at once",
        none_on(fast=True),
        reasons={0: told("PROBE_ERROR"), 1: ["PROBE_ERROR"]},
        internal_errors=("probe",)),
    Scenario(
        "probe exception on one rank (fail-open)", 2,
        _free() + _call(extra=", fail_open=True",
                        prelude="if RANK == 1:\n    dev.error = RuntimeError('driver exploded')"),
        "both create (FlashInfer entered once per rank)",
        created_on_all,
        internal_errors=("probe",)),
    Scenario(
        "device facts fail on one rank (a driver query raises)", 2,
        _free() + _call(extra=", on_veto='raise'", prelude="""
if RANK == 1:
    from flashinfer_safe_workspace.planning import probe as _probe
    def broken(*a, **k):
        raise _probe.DriverQueryFailed("cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) failed")
    dev.facts = broken"""),
        "both vetoed at once, naming rank 1's driver error (fail-closed)",
        lambda runs: (none_on(outcome="vetoed", fast=True)(runs),
                      _expect("rank 1" in _res(runs, 0)["err"] and "driver" in _res(runs, 0)["err"], _res(runs, 0))),
        reasons={0: told("DRIVER_ERROR"), 1: ["DRIVER_ERROR"]},
        internal_errors=("facts",)),
    Scenario(
        "backend auto on one rank, trtllm on the other", 2,
        _free() + _call(extra=", on_veto='raise'", backend="('auto' if RANK == 0 else 'trtllm')"),
        "both vetoed; both name both values (the rank told by its peer at once, the other at once or at its timeout)",
        lambda runs: [(none_on(outcome="vetoed")(runs),
                       _expect("backend differs: 'auto' on rank 0; 'trtllm' on rank 1" in _res(runs, r)["err"],
                               _res(runs, r))) for r in range(2)],
        t=VOTE_TIMEOUT, reasons={0: told("ARG_MISMATCH"), 1: told("ARG_MISMATCH")}),
    Scenario(
        "world_size 1 on one rank, 2 on the other", 2,
        _free() + _call(extra=", on_veto='raise'", world_size="(1 if RANK == 0 else 2)"),
        "both vetoed at once (no rank creates alone)",
        none_on(outcome="vetoed", fast=True),
        reasons={0: told("ARG_MISMATCH"), 1: told("ARG_MISMATCH")}),
    Scenario(
        "mismatched max_token_num on one rank", 2,
        _free() + _call(extra=", on_veto='raise'", max_token_num="(2048 if RANK == 0 else 4096)"),
        "both vetoed, naming both values (see above for the time)",
        lambda runs: [(none_on(outcome="vetoed")(runs),
                       _expect("max_token_num differs: 2048 on rank 0; 4096 on rank 1" in _res(runs, r)["err"],
                               _res(runs, r))) for r in range(2)],
        t=VOTE_TIMEOUT, reasons={0: told("ARG_MISMATCH"), 1: told("ARG_MISMATCH")}),
    Scenario(
        "world_size argument disagrees with the group", 2,
        _free() + _call(extra=", on_veto='raise'", world_size=4),
        "both vetoed at once, naming world_size",
        lambda runs: [(none_on(outcome="vetoed", fast=True)(runs),
                       _expect("world_size=4" in _res(runs, r)["err"], _res(runs, r))) for r in range(2)],
        reasons={0: told("ARG_MISMATCH"), 1: told("ARG_MISMATCH")}),
    Scenario(
        "rank argument disagrees with the group", 2,
        _free() + _call(extra=", on_veto='raise'").replace("rank=RANK", "rank=0"),
        "both vetoed",
        none_on(outcome="vetoed", fast=True),
        reasons={0: told("ARG_MISMATCH"), 1: told("ARG_MISMATCH")}),
    Scenario(
        "one rank's arguments rejected by FlashInfer, then a good call", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
first = rank_lib.create(rank=RANK, backend=("bogus" if RANK == 1 else "trtllm"))
first_reasons = rank_lib.last_reasons
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=1024)
result.update(first=first[0], first_secs=first[1], first_err=first[2], outcome=outcome, secs=secs,
              first_reasons=first_reasons, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "1st call: None on both, fast (FlashInfer would reject rank 1's call only: nobody enters it); "
        "2nd call: created on both (no misalignment)",
        lambda runs: (created_on_all(runs),
                      [_expect(_res(runs, r)["first"] == "none", _res(runs, r)) for r in (0, 1)],
                      [at_once(runs, r, "first_secs") for r in (0, 1)],
                      [_expect(_res(runs, r)["first_reasons"] in FIRST_OF_REJECTED, _res(runs, r))
                       for r in (0, 1)])),
    Scenario(
        "the same bad argument on every rank", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
outcome, secs, err = rank_lib.create(rank=RANK, backend="bogus")
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "FlashInfer's own error on both, at once (every rank passes through)",
        lambda runs: [(_expect(_res(runs, r)["outcome"] == "error" and "bogus" in _res(runs, r)["err"],
                               _res(runs, r)), at_once(runs, r)) for r in (0, 1)]),
    Scenario(
        "cached veto on one rank while its peer makes a new call, then both agree again", 2,
        _free("rank_lib.need_mb(max_token_num=2048) - 2 if RANK == 0 else None") + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
a = rank_lib.create(rank=RANK)  # both vetoed (rank 0 short): cached on both
a_reasons = rank_lib.last_reasons
b = rank_lib.create(rank=RANK, max_token_num=(2048 if RANK == 0 else 512))  # rank 0: cache; rank 1: a new round alone
b_reasons = rank_lib.last_reasons
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=256)  # both: a new call that fits
result.update(a=a[0], b=b[0], b_secs=b[1], a_reasons=a_reasons, b_reasons=b_reasons,
              outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "1st: None on both; 2nd: None on both (rank 1, behind, gives way without waiting out its "
        "timeout); 3rd: created on both (re-aligned)",
        lambda runs: (created_on_all(runs),
                      _expect([_res(runs, r)["a"] for r in (0, 1)] == ["none", "none"], runs),
                      _expect([_res(runs, r)["b"] for r in (0, 1)] == ["none", "none"], runs),
                      at_once(runs, 1, "b_secs"),
                      _cached_reasons(runs, short=0))),
    Scenario(
        "cached veto on rank 1 while rank 0 makes a new call, then both agree again", 2,
        _free("rank_lib.need_mb(max_token_num=2048) - 2 if RANK == 1 else None") + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
a = rank_lib.create(rank=RANK)  # both vetoed (rank 1 short): cached on both
a_reasons = rank_lib.last_reasons
b = rank_lib.create(rank=RANK, max_token_num=(2048 if RANK == 1 else 512))  # rank 1: cache; rank 0: a new round alone
b_reasons = rank_lib.last_reasons
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=256)  # both: a new call that fits
result.update(a=a[0], b=b[0], b_secs=b[1], a_reasons=a_reasons, b_reasons=b_reasons,
              outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "the same with the roles of the ranks swapped: rank 0, behind, gives way at once "
        "(its peer has made more calls) and both create on the third call",
        lambda runs: (created_on_all(runs),
                      _expect([_res(runs, r)["a"] for r in (0, 1)] == ["none", "none"], runs),
                      _expect([_res(runs, r)["b"] for r in (0, 1)] == ["none", "none"], runs),
                      at_once(runs, 0, "b_secs"),
                      _cached_reasons(runs, short=1))),
    Scenario(
        "a mismatched call, then a clean one: the clean one is created on both at once", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
first = rank_lib.create(rank=RANK, max_token_num=(2048 if RANK == 0 else 4096))
first_reasons = rank_lib.last_reasons
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=1024)
result.update(first=first[0], first_secs=first[1], first_reasons=first_reasons, outcome=outcome,
              secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "1st: None on both at once, naming both values; 2nd (the same on both): created on "
        "both at once (at 7c21911 the ranks that saw the mismatch followed their own abort of "
        "the other's round, and the mismatching rank waited out its whole vote timeout)",
        lambda runs: (created_on_all(runs),
                      [_expect(_res(runs, r)["first"] == "none", _res(runs, r)) for r in (0, 1)],
                      [_expect(_res(runs, r)["first_reasons"] == ["ARG_MISMATCH"], _res(runs, r))
                       for r in (0, 1)],
                      [at_once(runs, r, "first_secs") for r in (0, 1)],
                      [at_once(runs, r) for r in (0, 1)])),
    Scenario(
        "rank 0 calls 1000 then 1024, rank 1 calls 1024 then 1024: no call is created on one "
        "rank only", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
first = rank_lib.create(rank=RANK, max_token_num=(1000 if RANK == 0 else 1024))
first_calls = len(rank_lib.calls)
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=1024)
result.update(first=first[0], first_calls=first_calls, outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "1st call (1000 against 1024): None on both; 2nd (1024 on both): created on both. "
        "At 7c21911 rank 1's first call paired with rank 0's second, and was created on rank "
        "1 while rank 0's first was not",
        lambda runs: (created_on_all(runs),
                      [_expect((_res(runs, r)["first"], _res(runs, r)["first_calls"]) ==
                               ("none", 0), _res(runs, r)) for r in (0, 1)],
                      [_expect(_res(runs, r)["calls"] == 1, _res(runs, r)) for r in (0, 1)])),
    Scenario(
        "comm_backend whose allgather returns fewer records than ranks", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
class ShortGather:
    def Get_rank(self): return RANK
    def Get_size(self): return 2
    def allgather(self, obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out[:1] if RANK == 0 else out
    def barrier(self): dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK, comm_backend=ShortGather())
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "both None (rank 0 rejects the short answer; rank 1 learns it in the second exchange)",
        none_on(fast=True),
        reasons={0: ["INCOMPLETE"], 1: ["INCOMPLETE"]}),
    Scenario(
        "comm_backend without a torch group: a one-off argument mismatch, then a matching call", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
class Gather:
    def Get_rank(self): return RANK
    def Get_size(self): return 2
    def allgather(self, obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out
    def barrier(self): dist.barrier()
dist.barrier()
first = rank_lib.create(rank=RANK, comm_backend=Gather(), **({"max_token_num": 1024} if RANK == 0 else {}))
dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK, comm_backend=Gather())
result.update(first=first[0], outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls),
              live=dev.live_bytes)
""",
        "1st: None on both (the calls differ); 2nd: created on both at once (a mismatch over "
        "a comm backend is not cached either)",
        lambda runs: (created_on_all(runs),
                      _expect([_res(runs, r)["first"] for r in (0, 1)] == ["none", "none"], runs),
                      [at_once(runs, r) for r in (0, 1)])),
    Scenario(
        "2-rank subgroup of 4, other ranks busy", 4,
        _free() + """
sub = dist.new_group([0, 1], backend="gloo")
if RANK in (0, 1):
    dev = rank_lib.setup(free_mb=(1 if RANK == 1 else None), vote_timeout=T)
    outcome, secs, err = rank_lib.create(rank=RANK, group=sub)
    result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
    mark(f"sub-{RANK}")
else:  # busy until both members have decided
    await_mark("sub-0", "sub-1")
    result.update(outcome="busy", secs=0.0, calls=0, live=0, t=T)
""",
        "ranks 0,1 None at once; ranks 2,3 never involved",
        none_on([0, 1], fast=True),
        reasons={0: told("OUT_OF_MEMORY"), 1: ["OUT_OF_MEMORY"]}),
    Scenario(
        "two threads per rank at once, one rank set", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
outs = [None, None]
def go(i):
    outs[i] = rank_lib.create(rank=RANK)
threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
[t.start() for t in threads]; [t.join(30) for t in threads]
result.update(outcome="/".join(o[0] for o in outs), secs=max(o[1] for o in outs),
              calls=len(rank_lib.calls), live=dev.live_bytes, probes=dev.probes)
""",
        "each thread's call decides once, serialised per rank set; all created",
        lambda runs: (created_on_all(runs),
                      [_expect(_res(runs, r)["outcome"] == "created/created" and _res(runs, r)["calls"] == 2,
                               _res(runs, r)) for r in range(2)])),
    Scenario(
        "two threads per rank making two different calls, in opposite order on the two ranks", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
outs = {}
def go(name, tokens, delay):
    time.sleep(delay)
    outs[name] = rank_lib.create(rank=RANK, max_token_num=tokens)[0]
delays = {0: (0.0, 0.3), 1: (0.3, 0.0)}[RANK]  # rank 0 starts X first, rank 1 starts Y first
threads = [threading.Thread(target=go, args=("X", 1024, delays[0])),
           threading.Thread(target=go, args=("Y", 2048, delays[1]))]
[t.start() for t in threads]; [t.join(30) for t in threads]
again = {name: rank_lib.create(rank=RANK, max_token_num=tokens)[0]
         for name, tokens in (("X", 1024), ("Y", 2048))}
result.update(outs=outs, again=again, outcome=again["Y"], secs=0.0, calls=len(rank_lib.calls),
              live=dev.live_bytes)
""",
        "each call has the same answer on both ranks (a call that met the other in the "
        "other's round is vetoed on both); asked again, both calls are created: a "
        "mismatch is not cached",
        lambda runs: (all_or_none(runs),
                      _expect(_res(runs, 0)["outs"] == _res(runs, 1)["outs"], runs),
                      [_expect(_res(runs, r)["again"] == {"X": "created", "Y": "created"}, runs)
                       for r in (0, 1)])),
    Scenario(
        "two threads, two groups, opposite order on two ranks", 3,
        _free() + """
ga = dist.new_group([0, 1], backend="gloo")
gb = dist.new_group([0, 1, 2], backend="gloo")
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
outs = {}
def go(name, group, ws, delay):
    time.sleep(delay)
    outs[name] = rank_lib.create(rank=dist.get_rank(group), world_size=ws, group=group)
order = {0: (0.0, 0.4), 1: (0.4, 0.0), 2: (None, 0.0)}[RANK]
threads = []
if order[0] is not None:
    threads.append(threading.Thread(target=go, args=("a", ga, 2, order[0])))
threads.append(threading.Thread(target=go, args=("b", gb, 3, order[1])))
[t.start() for t in threads]; [t.join(30) for t in threads]
result.update(outcome="/".join(outs[k][0] for k in sorted(outs)), secs=max(o[1] for o in outs.values()),
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "no stall: both workspaces created on their ranks, each well within the bound",
        lambda runs: [(_expect(_res(runs, r)["outcome"] == ("created/created" if r < 2 else "created"),
                               _res(runs, r)), at_once(runs, r)) for r in range(3)]),
    Scenario(
        "fork() while another thread votes", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
voting = threading.Event()
if RANK == 1:
    await_mark("forked-0")  # rank 0 forks while its main thread waits for this rank
else:
    rank_lib.at("round.published", voting.set)
child = {}
def fork_soon():
    voting.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: our locks and in-flight state were reset at fork
        t0 = time.perf_counter()
        o = rank_lib.create(rank=RANK)
        os.write(w, json.dumps([o[0], time.perf_counter() - t0]).encode()); os._exit(0)
    os.close(w)
    child["pid"] = pid
    mark("forked-0")
r, w = os.pipe()
if RANK == 0:
    threading.Thread(target=fork_soon, daemon=True).start()
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 0:
    end = time.monotonic() + 60
    while "pid" not in child and time.monotonic() < end: time.sleep(0.01)
    os.waitpid(child["pid"], 0)
    result["child"] = json.loads(os.read(r, 1000).decode())
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "the parents create on both; the forked child gets None at once (it is no rank) and does not hang",
        lambda runs: (created_on_all(runs),
                      _expect(_res(runs, 0)["child"][0] == "none" and _res(runs, 0)["child"][1] < _res(runs, 0)["t"],
                              _res(runs, 0)))),
    Scenario(
        "WORLD given per device (cpu:gloo,cuda:gloo; NCCL is not built into CPU torch)", 2,
        _free(SHORT0) + _call(),
        "both None: the decision needs no gloo group of ours and no collective",
        none_on(fast=True), env={"FIWS_TEST_BACKEND": "cpu:gloo,cuda:gloo"},
        reasons={0: ["OUT_OF_MEMORY"], 1: told("OUT_OF_MEMORY")}),
    Scenario(
        "bad environment values", 2,
        _free(SHORT0) + """
dev = rank_lib.setup(free_mb=FREE)
from flashinfer_safe_workspace import _config
s = _config.current()
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes,
              settings=[s.headroom_mb, s.vote_timeout, s.on_veto])
""",
        "one warning per bad variable (and one for the misspelt name), defaults used, veto still works",
        lambda runs: [(none_on()(runs),
                       _expect(_res(runs, r)["settings"] == ["auto", 120.0, "auto"]
                               and runs[r]["stderr"].count("ignoring FLASHINFER_SAFE_WORKSPACE_") == 3
                               and "did you mean FLASHINFER_SAFE_WORKSPACE_ON_VETO" in runs[r]["stderr"],
                               (runs[r]["stderr"], _res(runs, r)))) for r in range(2)],
        env={"FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB": "-5", "FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT": "1e14",
             "FLASHINFER_SAFE_WORKSPACE_ON_VETO": "explode", "FLASHINFER_SAFE_WORKSPACE_ON_VET0": "raise"},
        reasons={0: ["OUT_OF_MEMORY"], 1: told("OUT_OF_MEMORY")}),
    Scenario(
        "internal error in our code on one rank", 2,
        _free() + _call(prelude="""
if RANK == 0:
    import flashinfer_safe_workspace.planning.request as rq
    def boom(*a, **k):
        raise ZeroDivisionError("injected")
    rq.plan_for = boom""") + """
result["internal"] = [w for w in rank_lib.warnings() if "internal error in" in w]
""",
        "fail-closed: both None at once; one warning on the failing rank",
        lambda runs: (none_on(fast=True)(runs),
                      _expect(len(_res(runs, 0)["internal"]) == 1, _res(runs, 0)),
                      _expect([r["internal_errors"] for r in runs] == [["plan"], []], runs),
                      _expect(len(_res(runs, 1)["internal"]) == 0, _res(runs, 1))),
        reasons={0: ["INTERNAL_ERROR"], 1: told("INTERNAL_ERROR")},
        internal_errors=("plan",)),
    Scenario(
        "creation watchdog, ON_HANG=abort", 1,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, create_timeout=%r, on_hang="abort")
import flashinfer.comm.allreduce as ar
class Blocking(rank_lib.RecordingWorkspace):
    def __init__(self, **kw):  # past the harness's own timeout: only the watchdog ends it
        threading.Event().wait(600)
ar.TRTLLMAllReduceFusionWorkspace = Blocking
t0 = time.time()
rank_lib.create(rank=RANK, world_size=1)
result.update(outcome="returned", secs=time.time() - t0)
""" % WATCHDOG_T,
        "process exits with status 70 about 1 s into FlashInfer's call, with a message",
        _aborted_by_the_watchdog, host=False),
]


# The splits an adversarial run found on the protocol without acknowledgements: each must
# now end with the same answer on every rank that answers.
SCENARIOS += [
    Scenario(
        "rank killed (SIGKILL) after publishing yes; its peer arrives later", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:  # killed with its record in, before it could acknowledge anything
    rank_lib.at("round.published", lambda: (mark("published-1"), os.kill(os.getpid(), signal.SIGKILL)))
    rank_lib.create(rank=RANK)
await_mark("published-1")
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 0 completes the count with the dead rank's yes and creates at once: a yes counts "
        "once it is in (a rank that dies after it takes its engine down; FlashInfer's own "
        "exchange meets the dead peer as any collective of the engine would)",
        lambda runs: (_expect(_res(runs, 0)["outcome"] == "created", _res(runs, 0)),
                      at_once(runs, 0), _expect(runs[1]["returncode"] == -9, runs[1])),
        env={"FIWS_LINGER_S": "1"}, host=False, t=VOTE_TIMEOUT),
    Scenario(
        "rank killed (SIGKILL) after publishing yes; its peer arrives 1.5 s later", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:  # killed with its record in
    rank_lib.at("round.published", lambda: (mark("published-1"), os.kill(os.getpid(), signal.SIGKILL)))
    rank_lib.create(rank=RANK)
await_mark("published-1")
time.sleep(1.5)  # its record is older than process.STALE_S (1 s) when the count completes
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 0 completes the count and sees that the yes in it was written by a process "
        "that no longer runs: None at once, naming rank 1 absent (issue 29's review, F3: the "
        "same check keeps a new job from committing on an earlier job's record)",
        lambda runs: (_expect(_res(runs, 0)["outcome"] == "none", _res(runs, 0)),
                      at_once(runs, 0), _expect(runs[1]["returncode"] == -9, runs[1])),
        env={"FIWS_LINGER_S": "1"}, host=False, t=VOTE_TIMEOUT, reasons={0: ["ABSENT"]}),
    Scenario(
        "rank vetoes at its deadline while the store host is stopped, then exits", 2,
        _free() + """
import json, subprocess
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
resumed = []
signal.signal(signal.SIGCONT, lambda *a: resumed.append(1))
dist.barrier()
if RANK == 1:  # stops the store host once its own record is in
    host = peer_pid(0)
    rank_lib.at("round.published", lambda: os.kill(host, signal.SIGSTOP))
    outcome, secs, err = rank_lib.create(rank=RANK)
    # resume the store host once this rank is gone (exited or a zombie): its queued abort
    # is lost with it
    me = os.getpid()
    gone = f"[ ! -e /proc/{me} ] || grep -q '^State:.*Z' /proc/{me}/status"
    subprocess.Popen(["sh", "-c", f"i=0; until {gone} || [ $i -ge 3000 ]; do sleep 0.02; "
                      f"i=$((i+1)); done; kill -CONT {host}"], start_new_session=True)
    result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
    print("FIWS_RESULT " + json.dumps(result, default=str), flush=True)
    os._exit(0)
end = time.monotonic() + 60  # the store host reaches the call only after it was resumed
while not resumed and time.monotonic() < end:
    time.sleep(0.01)
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 1: None within the bound (in doubt), then exits; rank 0 resumes: None (rank 1 never acknowledged)",
        lambda runs: (all_or_none(runs, [1]), all_or_none(runs, [0]),
                      _expect([_res(runs, r)["outcome"] for r in (0, 1)] == ["none", "none"], runs)),
        env={"FIWS_LINGER_S": "1"}, host=False, timeout=90, t=VOTE_TIMEOUT),
    Scenario(
        "store frozen right after the commit, ranks 0.5 s apart", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
dist.barrier()
if RANK == 0:  # in second: it proposes; the register says commit; it freezes before reading it
    await_mark("published-1")
    rank_lib.at("round.before_register", lambda: (await_mark("returned-1"), rank_lib.stop_self()))
    outcome, secs, err = rank_lib.create(rank=RANK)
else:
    host = peer_pid(0)
    rank_lib.at("round.published", lambda: mark("published-1"))
    outcome, secs, err = rank_lib.create(rank=RANK)
    mark("returned-1")
    result["stopped"] = rank_lib.wait_stopped(host)
    time.sleep(T + 0.5)  # at least until the store host's own deadline has passed
    os.kill(host, signal.SIGCONT)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "created on both: rank 1 wrote the commit; rank 0, frozen past its deadline, reads it on resume",
        lambda runs: (all_or_none(runs, [1]), all_or_none(runs, [0], timeouts=2),
                      _expect(_res(runs, 1)["stopped"] is True, runs),
                      _expect([_res(runs, r)["outcome"] for r in (0, 1)] == ["created", "created"], runs)),
        timeout=90, t=6.0),
    Scenario(
        "store host exits while its peer waits", 2,
        _free() + """
import json
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
rank_lib.at("round.published", lambda: mark("published-1"))
dist.barrier()
if RANK == 0:
    await_mark("published-1")  # its peer waits for its record
    os._exit(0)
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
print("FIWS_RESULT " + json.dumps(result, default=str), flush=True)
os._exit(0)  # before the harness's own store operations, which torch would log as well
""",
        "rank 1: None within the bound; torch logs at most one failed operation per connection of ours (not one per operation)",
        lambda runs: (all_or_none(runs, [1]), _expect(_res(runs, 1)["outcome"] == "none", runs[1]),
                      _expect(runs[1]["stderr"].count("Exception raised from") <= 2, runs[1]["stderr"])),
        env={"FIWS_STDERR_TAIL": "100000"}, host=False, t=VOTE_TIMEOUT),
    Scenario(
        "the host destroys its default group and initialises a new one (a new store)", 2,
        _free("rank_lib.need_mb() - 2 if RANK == 0 else None") + """
import datetime, harness
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
before = rank_lib.create(rank=RANK)  # rank 0 short: vetoed on both, cached
port = STORE.get("port2").decode() if RANK else harness.free_port()
if RANK == 0:
    STORE.set("port2", str(port))
dist.barrier()
dist.destroy_process_group()
del STORE
dev.free_bytes = 80 << 30  # the new world's GPUs have room
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
after = rank_lib.create(rank=RANK)  # the same call: decided afresh, not from the old cache
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=1024)
result.update(before=before[0], after=after[0], outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "before: None on both; after the new init_process_group the same call is created on "
        "both (no veto of the old group's store, cache or bookkeeping survives), then another",
        lambda runs: (created_on_all(runs),
                      _expect([_res(runs, r)["before"] for r in (0, 1)] == ["none", "none"], runs),
                      _expect([_res(runs, r)["after"] for r in (0, 1)] == ["created", "created"], runs),
                      _expect(all(_res(runs, r)["calls"] == 2 for r in (0, 1)), runs),
                      _expect(all("Exception raised from" not in r["stderr"] for r in runs), runs)),
        env={"FIWS_STDERR_TAIL": "100000"}, host=False),
    Scenario(
        "a thread still deciding on the old group while the host replaces it", 2,
        _free() + """
import datetime, harness
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
old = {}
def old_call():
    old["x"] = rank_lib.create(rank=RANK, max_token_num=512)[0]
if RANK == 1:  # the old call holds in its probe while the group is replaced
    in_probe, replaced = threading.Event(), threading.Event()
    def hold():  # the first probe is the old call's (its steps run on the set's worker)
        if not in_probe.is_set():
            in_probe.set(); replaced.wait(60)
    rank_lib.at("probe", hold)
    thread = threading.Thread(target=old_call); thread.start()
    in_probe.wait(60)
port = STORE.get("port2").decode() if RANK else harness.free_port()
if RANK == 0:
    STORE.set("port2", str(port))
dist.barrier()
dist.destroy_process_group()
del STORE  # the old store goes: the old thread's next operation fails
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
if RANK == 1:
    replaced.set()
rank_lib.relax(LONG_T); result["t"] = LONG_T  # the new group's calls must be created, also under load
first = rank_lib.create(rank=RANK, max_token_num=1024)[0]
if RANK == 1:
    thread.join(30)
dist.barrier()
again = rank_lib.create(rank=RANK, max_token_num=512)  # the old thread's call, in the new group
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=256)
result.update(old=old, first=first, again=again[0], outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "the old thread's call ends None on its own; in the new group every call is created "
        "on both ranks, that call too: the old round's failure, bookkeeping and veto stay "
        "with the old group",
        lambda runs: (created_on_all(runs),
                      _expect(_res(runs, 1)["old"] == {"x": "none"}, runs),
                      [_expect((_res(runs, r)["first"], _res(runs, r)["again"]) ==
                               ("created", "created"), runs) for r in (0, 1)]),
        env={"FIWS_STDERR_TAIL": "100000"}, host=False, timeout=90, t=VOTE_TIMEOUT),
    Scenario(
        "rank 1 makes one call more than rank 0: its calls are out of step, every call is "
        "vetoed at once, and both ranks cache the same veto", 2,
        _free("rank_lib.need_mb() - 2 if RANK == 1 else None") + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=LONG_T)
out = []
if RANK == 1:
    out.append(rank_lib.create(rank=RANK, max_token_num=1024))  # a call rank 0 never makes
first = rank_lib.create(rank=RANK)  # rank 1 is short for it
out.append(first + (rank_lib.last_reasons,))
dev.free_bytes = 80 << 30  # rank 1 has room now
again = rank_lib.create(rank=RANK)  # the same call again
out.append(again + (rank_lib.last_reasons,))
result.update(out=[(o[0], o[1], o[3] if len(o) > 3 else None) for o in out], outcome=again[0],
              secs=again[1], err=again[2], calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 0's first call meets rank 1's extra one (a mismatch, cached by neither); rank "
        "0's second meets rank 1's first, where rank 1 is short (both cache that veto); rank "
        "1's second is its cached veto. Nothing created, every answer before the timeout",
        lambda runs: (none_on()(runs),
                      [_expect(all(o[0] == "none" and o[1] < LONG_T for o in _res(runs, r)["out"]),
                               _res(runs, r)) for r in (0, 1)],
                      _expect([o[2] for o in _res(runs, 0)["out"]] ==
                              [["ARG_MISMATCH"], ["OUT_OF_MEMORY"]], _res(runs, 0)),
                      _expect([o[2] for o in _res(runs, 1)["out"]][1:] ==
                              [["OUT_OF_MEMORY"], None], _res(runs, 1))), t=LONG_T),
]

SCALE_CI = 8  # ranks of the scale cases in CI (2 cores); scripts/reliability-matrix --scale N


def scale_scenarios(world: int) -> list:
    """The fault cases at ``world`` ranks: one rank starved, one rank dead before its record,
    the store host stopped for 2 s inside a round. Ranks meet at a barrier of the test's own
    first (so that start-up skew of many processes does not eat the vote timeout)."""
    last = world - 1
    meet = "dist.barrier()\n"
    return [
        Scenario(
            f"{world} ranks: rank {last} starved", world,
            _free(f"rank_lib.need_mb(world_size={world}) - 2 if RANK == {last} else None")
            + _call(prelude=meet, world_size=world),
            "None on every rank, within the bound", none_on(), env={"CUDA_VISIBLE_DEVICES": ""},
            timeout=240, reasons={r: (["OUT_OF_MEMORY"], ["ABORTED"]) if r != last else ["OUT_OF_MEMORY"]
                                   for r in range(world)}),
        Scenario(
            f"{world} ranks: rank {last} dead before its record", world,
            _free() + f"alive = dist.new_group(list(range({last})))\nif RANK == {last}:\n"
            "    os._exit(1)\n" + _call(prelude="dist.barrier(group=alive)", world_size=world),
            "None on every other rank, within the bound (STORE_ERROR only where the store "
            "host did not answer the abort at the deadline within the grace)",
            lambda runs: (none_on(list(range(last)))(runs), store_error_is_a_timeout(runs, range(last))),
            env={"FIWS_LINGER_S": "3", "CUDA_VISIBLE_DEVICES": ""}, host=False, timeout=240,
            # every rank waits out its deadline at once, then writes the abort: on a loaded
            # machine the one store host may answer later than GRACE_S (+ the final 0.4 s try)
            t=VOTE_TIMEOUT, reasons={r: (["ABSENT"], ["ABORTED"], ["STORE_ERROR"])
                                     for r in range(last)}),
        Scenario(
            f"{world} ranks: store host stopped for 2 s inside a round", world,
            _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
host = peer_pid(0)
if RANK == 0:  # stops itself inside decide, before its record: the round is open
    rank_lib.at("probe", rank_lib.stop_self)
dist.barrier()
if RANK == 1:
    def stop_and_resume():  # for 2 s from the moment it has stopped (the store with it)
        rank_lib.wait_stopped(host)
        time.sleep(2.0); os.kill(host, signal.SIGCONT)
    threading.Thread(target=stop_and_resume, daemon=True).start()
outcome, secs, err = rank_lib.create(rank=RANK, world_size=%d)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""" % world,
            "created on every rank (the store answers again well within the vote timeout of 6 s)",
            lambda runs: _expect(all_or_none(runs), "expected a workspace on every rank"),
            env={"CUDA_VISIBLE_DEVICES": ""}, timeout=240, t=6.0),
    ]


def run(scenario: Scenario):
    env = {"FIWS_T": scenario.t, "FIWS_LINGER_S": 15}
    env.update(scenario.env)
    body = COMMON + scenario.body + (HOST if scenario.host else "")
    return run_ranks(scenario.world, body, env=env, timeout=scenario.timeout,
                     internal_errors=scenario.internal_errors)


# --------------------------------------------------------------------------- issue 23 (agree)
# F5: the register carries the deciding check, and every rank names it from there. Rank 0
# opens the round, then (in its probe) waits until rank 1, whose facts cannot be read, has
# said no and returned: rank 1 saw its own record only, rank 0 sees both.
FACTS_BROKEN = """
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
if RANK == 1:
    def broken(device=None):
        raise RuntimeError("the driver's facts could not be read")
    dev.rank_facts = broken
else:
    probe = dev.probe
    def held(*a, **k):
        STORE.set("f5/probing", "1")
        STORE.wait(["f5/answered"], datetime.timedelta(seconds=T))
        return probe(*a, **k)
    dev.probe = held
dist.barrier()
if RANK == 1:
    STORE.wait(["f5/probing"], datetime.timedelta(seconds=T))
outcome, secs, err = rank_lib.create(rank=RANK)
if RANK == 1:
    STORE.set("f5/answered", "1")
line = rank_lib.last_decision() or {}
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes, check=line.get("check"))
"""


def _same_check(runs):
    none_on()(runs)
    names = [_res(runs, r)["check"] for r in (0, 1)]
    _expect(names[0] == names[1] and names[0] not in (None, "-"), f"checks named: {names}")


SCENARIOS += [
    Scenario(
        "one rank's facts cannot be read while its peer is in its probe: both name one check", 2,
        "import datetime\n" + FACTS_BROKEN,
        "None on both; both decision lines name the check the register carries",
        _same_check, internal_errors=("rank_facts",)),
]

# F3: one rank's check (or probe) blocks. That rank says no within the bound, naming the
# step; its peer gets None within the bound too; once the step returns (in the background)
# nothing is held, and the next call is created on both.
STEP_BLOCKS = """
from flashinfer_safe_workspace.checks import packages
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
gate = threading.Event()  # set once this rank's first call has answered
if RANK == 1:
%s
dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK)
first = dict(outcome=outcome, secs=secs, reasons=rank_lib.last_reasons,
             check=(rank_lib.last_decision() or {}).get("check"))
gate.set()
rank_lib.relax(LONG_T); result["t"] = LONG_T  # the 2nd call must be created, also under load
dist.barrier()
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=1024)
result.update(first=first, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls),
              live=dev.live_bytes)
"""
CHECK_STUCK = """
    real = packages.local
    def stuck(ctx):
        gate.wait(4 * T)
        return real(ctx)
    packages.local = stuck
"""
PROBE_STUCK = """
    real = dev.probe
    def stuck(*a, **k):
        gate.wait(4 * T)
        return real(*a, **k)
    dev.probe = stuck
"""


def _step_late(check):
    def verify(runs):
        created_on_all(runs)  # the second call: created on both, nothing held
        firsts = [_res(runs, r)["first"] for r in (0, 1)]
        for f in firsts:
            _expect(f["outcome"] == "none" and f["secs"] <= BOUND, firsts)
        if any(f["reasons"] == ["STORE_ERROR"] for f in firsts):
            # the store host (rank 0) did not answer either rank's write within the grace
            # (seen once in a clean-clone run on a loaded 2-core machine): a veto in doubt,
            # never before the deadline plus the grace, and on every rank
            from flashinfer_safe_workspace.agreement.vote import GRACE_S
            _expect(all(f["secs"] >= VOTE_TIMEOUT + GRACE_S for f in firsts
                        if f["reasons"] == ["STORE_ERROR"]), firsts)
            return
        _expect(firsts[1]["reasons"] == ["STEP_TIMEOUT"], firsts)
        _expect(firsts[0]["reasons"] in (["STEP_TIMEOUT"], ["ABSENT"], ["ABORTED"]), firsts)
        _expect(firsts[1]["check"] == check, firsts)
    return verify


SCENARIOS += [
    Scenario("a check blocks on one rank: it answers within the bound, naming the check", 2,
             STEP_BLOCKS % CHECK_STUCK,
             "1st call: None on both within the bound (STEP_TIMEOUT, check=packages); 2nd: created",
             _step_late("packages"), t=VOTE_TIMEOUT),
    Scenario("the probe blocks on one rank: it answers within the bound", 2,
             STEP_BLOCKS % PROBE_STUCK,
             "1st call: None on both within the bound (STEP_TIMEOUT); 2nd: created, nothing held",
             _step_late("-"), t=VOTE_TIMEOUT),
]

# F1: with DEEP_PROBE=1, a rank that arrives after its round was aborted skips the checks;
# the deep probe pairs on the round itself, so the retries are created on both
DEEP_LATE = """
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
if RANK == 1:  # arrives once rank 0's first call has answered (its round aborted by then)
    STORE.wait(["f1/answered"], datetime.timedelta(seconds=4 * T))
first = rank_lib.create(rank=RANK)
if RANK == 0:
    STORE.set("f1/answered", "1")
dist.barrier()
import flashinfer_safe_workspace as fiws
fiws.uninstall()  # the veto is forgotten: the retries decide afresh
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
dist.barrier()
again = [rank_lib.create(rank=RANK)[0] for _ in range(2)]
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(first=first[0], again=again, outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes, exports=dev.exports_live)
"""


def _deep_recovers(runs):
    created_on_all(runs)
    for r in (0, 1):
        res = _res(runs, r)
        _expect(res["first"] == "none" and res["again"] == ["created", "created"], res)
        _expect(res["exports"] == 0, res)


DEEP_SLOW = """
import time as _t
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
dist.barrier()
if RANK == 1:  # arrives 0.6 T after rank 0's call began: later than half the vote timeout,
    # well inside it (one host: one wall clock)
    STORE.wait(["f2/started"], WAIT)
    _t.sleep(max(float(STORE.get("f2/started")) + 0.6 * T - _t.time(), 0))
else:
    STORE.set("f2/started", repr(_t.time()))
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes, exports=dev.exports_live)
"""

DEEP_ABSENT = """
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
dist.barrier()
if RANK == 1:  # never comes
    os._exit(0)
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err,
              calls=len(rank_lib.calls), live=dev.live_bytes, exports=dev.exports_live)
"""

SCENARIOS += [
    Scenario("deep probe: a rank later than half the vote timeout, inside it: created on both",
             2, DEEP_SLOW,
             "created on both (7c21911: rank 0's exchange gave up at half the vote timeout "
             "and vetoed, blaming an import that nobody had failed)",
             created_on_all, env={"FLASHINFER_SAFE_WORKSPACE_DEEP_PROBE": "1"}, t=8.0),
    Scenario("deep probe: a peer that never comes is named absent, not an import failure", 2,
             DEEP_ABSENT,
             "rank 0: None at its deadline, ABSENT (7c21911: DEEP_PROBE_FAILED, \"a peer could "
             "not import this rank's memory handle\")",
             none_on([0]), env={"FLASHINFER_SAFE_WORKSPACE_DEEP_PROBE": "1"}, host=False,
             t=VOTE_TIMEOUT, reasons={0: ["ABSENT"]}),
    Scenario("deep probe: a rank arrives after its round was aborted; the retries pair", 2,
             "import datetime\n" + DEEP_LATE,
             "1st call: None on both; every later call: created on both (714be8f: vetoed "
             "on every retry, blaming the store)",
             _deep_recovers, env={"FLASHINFER_SAFE_WORKSPACE_DEEP_PROBE": "1"},
             t=6.0),  # rank 0 waits its first call's timeout out: 6 s, not LONG_T
]
