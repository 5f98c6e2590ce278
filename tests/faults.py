"""The fault matrix: scenarios run as real multi-process gloo groups on the simulated device.

Shared by tests/test_faults.py (asserts) and scripts/reliability-matrix (writes
docs/reliability.md). Each scenario: ranks run ``body`` (with rank_lib helpers); every rank
reports its outcome, time to return and the simulated bytes still held.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from harness import run_ranks

VOTE_TIMEOUT = 3.0  # seconds, small so that the matrix runs quickly

COMMON = """
import os, threading
import rank_lib
T = float(os.environ.get("FIWS_T", "3"))
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


def _res(runs, rank):
    r = runs[rank]["result"]
    assert r is not None, f"rank {rank} gave no result (rc={runs[rank]['returncode']}):\n{runs[rank]['stderr']}"
    return r


def _all_none_within(bound, ranks=None):
    def check(runs):
        for rank in ranks if ranks is not None else range(len(runs)):
            r = _res(runs, rank)
            assert r["outcome"] == "none", r
            assert r["calls"] == 0, r
            assert r["secs"] <= bound, r
            assert r["live"] == 0, r
    return check


def _call(extra="", device_kwargs="", **create):
    args = ", ".join(f"{k}={v}" for k, v in create.items())
    return f"""
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T{extra}{device_kwargs})
outcome, secs, err = rank_lib.create(rank=RANK{', ' + args if args else ''})
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
"""


def _free(expr="None"):
    return f"FREE = {expr}\n"


SCENARIOS = [
    Scenario(
        "dead rank before the vote", 2,
        _free() + "if RANK == 1:\n    os._exit(1)\n" + _call(),
        "survivor returns None within the timeout; FlashInfer not entered",
        lambda runs: _all_none_within(VOTE_TIMEOUT + 1, ranks=[0])(runs)),
    Scenario(
        "dead rank during the probe", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:
    dev.probe = lambda *a, **k: os._exit(1)
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "survivor returns None within the timeout",
        lambda runs: _all_none_within(VOTE_TIMEOUT + 1, ranks=[0])(runs)),
    Scenario(
        "slow rank past the timeout", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 1:
    time.sleep(T + 2)
outcome, secs, err = rank_lib.create(rank=RANK)
from flashinfer_safe_workspace import _decide
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes,
              absent=_decide.last_report.get("absent"))
""",
        "both None (the late rank sees the expired yes); the log names rank 1 as absent",
        lambda runs: (_all_none_within(VOTE_TIMEOUT + 1)(runs),
                      _expect(_res(runs, 0)["absent"] == [1], "absent rank named"))),
    Scenario(
        "probe exception on one rank (fail-closed)", 2,
        _free() + _call(device_kwargs="") .replace(
            "dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)",
            "dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)\n"
            "if RANK == 1:\n    dev.error = RuntimeError('driver exploded')"),
        "both None",
        _all_none_within(VOTE_TIMEOUT + 1)),
    Scenario(
        "probe exception on one rank (fail-open)", 2,
        _free() + _call(extra=", fail_open=True").replace(
            "dev = rank_lib.setup(free_mb=FREE, vote_timeout=T, fail_open=True)",
            "dev = rank_lib.setup(free_mb=FREE, vote_timeout=T, fail_open=True)\n"
            "if RANK == 1:\n    dev.error = RuntimeError('driver exploded')"),
        "both create (FlashInfer entered once per rank)",
        lambda runs: [_expect(_res(runs, r)["outcome"] == "created" and _res(runs, r)["calls"] == 1
                              and _res(runs, r)["live"] == 0, _res(runs, r)) for r in range(2)]),
    Scenario(
        "mismatched max_token_num on one rank", 2,
        _free() + _call(extra=", on_veto='raise'",
                        max_token_num="(2048 if RANK == 0 else 4096)"),
        "WorkspaceVetoed on both, naming the disagreeing rank",
        lambda runs: [_expect(_res(runs, r)["outcome"] == "vetoed" and "different arguments"
                              in _res(runs, r)["err"] and _res(runs, r)["calls"] == 0, _res(runs, r))
                      for r in range(2)]),
    Scenario(
        "world_size argument disagrees with the group", 2,
        _free() + _call(extra=", on_veto='raise'", world_size=4),
        "WorkspaceVetoed on both at once, naming world_size",
        lambda runs: [_expect(_res(runs, r)["outcome"] == "vetoed" and "arguments disagree"
                              in _res(runs, r)["err"] and _res(runs, r)["secs"] < 2, _res(runs, r))
                      for r in range(2)]),
    Scenario(
        "rank argument disagrees with the group", 2,
        _free() + _call(extra=", on_veto='raise'").replace("rank=RANK", "rank=0"),
        "WorkspaceVetoed on both",
        lambda runs: [_expect(_res(runs, r)["outcome"] == "vetoed", _res(runs, r)) for r in range(2)]),
    Scenario(
        "2-rank subgroup of 4, other ranks busy", 4,
        _free() + """
import torch.distributed as dist
sub = dist.new_group([0, 1], backend="gloo")
if RANK in (0, 1):
    dev = rank_lib.setup(free_mb=(1 if RANK == 1 else None), vote_timeout=T)
    outcome, secs, err = rank_lib.create(rank=RANK, group=sub)
    result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
else:
    time.sleep(T + 1)
    result.update(outcome="busy", secs=0.0, calls=0, live=0)
""",
        "ranks 0,1 None at once; ranks 2,3 never involved",
        lambda runs: _all_none_within(1.0, ranks=[0, 1])(runs)),
    Scenario(
        "two threads per rank at once", 2,
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
        "each thread's call votes once, serialised; all created",
        lambda runs: [_expect(_res(runs, r)["outcome"] == "created/created"
                              and _res(runs, r)["calls"] == 2 and _res(runs, r)["probes"] == 2
                              and _res(runs, r)["live"] == 0, _res(runs, r)) for r in range(2)]),
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
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "rank 1: interrupt propagates, nothing held; rank 0: None within the timeout",
        lambda runs: (_all_none_within(VOTE_TIMEOUT + 1, ranks=[0])(runs),
                      _expect(_res(runs, 1)["outcome"] == "interrupted" and _res(runs, 1)["live"] == 0,
                              _res(runs, 1)))),
    Scenario(
        "bad environment values", 2,
        _free("rank_lib.need_mb() - 2 if RANK == 0 else None") + """
dev = rank_lib.setup(free_mb=FREE)
from flashinfer_safe_workspace import _config
s = _config.current()
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes,
              settings=[s.headroom_mb, s.vote_timeout, s.on_veto])
""",
        "one warning per bad variable, defaults used, veto still works",
        lambda runs: [_expect(_res(runs, r)["settings"] == [512, 120.0, "none"]
                              and _res(runs, r)["outcome"] == "none"
                              and runs[r]["stderr"].count("ignoring FLASHINFER_SAFE_WORKSPACE_") == 3,
                              (runs[r]["stderr"], _res(runs, r))) for r in range(2)],
        env={"FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB": "-5", "FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT": "abc",
             "FLASHINFER_SAFE_WORKSPACE_ON_VETO": "explode"}),
    Scenario(
        "internal error in our code on one rank", 2,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
if RANK == 0:
    import flashinfer_safe_workspace._decide as d
    def boom(*a, **k):
        raise ZeroDivisionError("injected")
    d.make_plan = boom
outcome, secs, err = rank_lib.create(rank=RANK)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
""",
        "fail-closed: both None; one warning on the failing rank",
        lambda runs: (_all_none_within(VOTE_TIMEOUT + 1)(runs),
                      _expect(runs[0]["stderr"].count("internal error in") == 1, runs[0]["stderr"]))),
    Scenario(
        "creation watchdog, ON_HANG=abort", 1,
        _free() + """
dev = rank_lib.setup(free_mb=FREE, create_timeout=1.0, on_hang="abort")
import flashinfer.comm.allreduce as ar
class Blocking(rank_lib.RecordingWorkspace):
    def __init__(self, **kw):
        time.sleep(60)
ar.TRTLLMAllReduceFusionWorkspace = Blocking
t0 = time.time()
rank_lib.create(rank=RANK, world_size=1)
result.update(outcome="returned", secs=time.time() - t0)
""",
        "process exits with status 70 about 1 s into FlashInfer's call, with a message",
        lambda runs: _expect(runs[0]["returncode"] == 70 and runs[0]["result"] is None
                             and "Aborting (ON_HANG=abort)" in runs[0]["stderr"]
                             and runs[0]["wall_s"] < 30, runs[0])),
]


def _expect(cond, what):
    assert cond, what
    return True


def run(scenario: Scenario):
    env = {"FIWS_T": VOTE_TIMEOUT}
    env.update(scenario.env)
    return run_ranks(scenario.world, COMMON + scenario.body, env=env, timeout=scenario.timeout)
