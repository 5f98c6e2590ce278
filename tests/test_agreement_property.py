"""Property: whatever each rank's arguments, local failures and arrival delays, the workspace
is created on every rank that called or on none, and every rank returns within the bound.

Hypothesis draws whole sequences of calls for 2-4 real gloo ranks (one process set per
example, the calls made back to back with no synchronisation between them, as engines do);
the simulated device is the only stand-in. Each call uses its own shape, so a veto cached by
an earlier call of the sequence does not answer a later one.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from harness import results, run_ranks

T = 2.0
BOUND = T + 2.0
FAULTS = ("none", "none", "none", "short", "probe_error", "facts_error", "bad_backend",
          "other_shape", "world_size_1")

BODY = """
import json, os, time
import rank_lib
from flashinfer_safe_workspace.planning import probe as _probe
PLAN = json.loads(os.environ["FIWS_PLAN"])
dev = rank_lib.setup(free_mb=None, vote_timeout=%(T)s)
real_facts = dev.facts
out = []
for i, step in enumerate(PLAN):
    delay, fault = step[RANK]
    dev.free_bytes, dev.error, dev.facts = 80 << 30, None, real_facts
    kwargs = dict(rank=RANK, max_token_num=64 * (i + 1), hidden_dim=1024)
    if fault == "short":
        dev.free_bytes = 1 << 20
    elif fault == "probe_error":
        dev.error = RuntimeError("injected probe error")
    elif fault == "facts_error":
        def broken(*a, **k):
            raise _probe.DriverQueryFailed("injected driver query failure")
        dev.facts = broken
    elif fault == "bad_backend":
        kwargs["backend"] = "bogus"
    elif fault == "other_shape":
        kwargs["hidden_dim"] = 2048
    elif fault == "world_size_1":
        kwargs["world_size"] = 1
    time.sleep(delay)
    before = len(rank_lib.calls)
    outcome, secs, err = rank_lib.create(**kwargs)
    out.append({"created": len(rank_lib.calls) > before, "outcome": outcome, "secs": secs,
                "live": dev.live_bytes})
result["steps"] = out
""" % {"T": T}


def _plans(world):
    step = st.lists(st.tuples(st.sampled_from((0.0, 0.0, 0.05, 0.3)), st.sampled_from(FAULTS)),
                    min_size=world, max_size=world)
    return st.lists(step, min_size=4, max_size=8)


@st.composite
def _cases(draw):
    world = draw(st.sampled_from((2, 2, 3, 4)))
    return world, draw(_plans(world))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_cases())
def test_created_on_every_rank_or_on_none(case):
    world, plan = case
    runs = run_ranks(world, BODY, env={"FIWS_PLAN": json.dumps(plan), "FIWS_LINGER_S": 30},
                     timeout=60 + len(plan) * (BOUND + 1))
    per_rank = [r["steps"] for r in results(runs)]
    clean_before = True  # the previous call was fault-free and created: no rank is behind
    for i, step in enumerate(plan):
        got = [per_rank[r][i] for r in range(world)]
        created = [g["created"] for g in got]
        assert all(created) or not any(created), (i, step, got)
        for g in got:
            assert g["secs"] <= BOUND, (i, step, got)
            assert g["live"] == 0, (i, step, got)
        clean = all(f == "none" for _, f in step)
        if clean and clean_before:  # nothing wrong anywhere, nobody behind: it must be created
            assert all(created), (i, step, got)
        clean_before = clean and all(created)
