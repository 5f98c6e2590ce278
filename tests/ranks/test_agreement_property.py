"""Property: whatever each rank's arguments, local failures and arrival delays, the workspace
is created on every rank that called or on none, every rank returns within the bound, the
simulated device holds nothing afterwards, and a veto gives the reason the faults call for.

Hypothesis draws, per example, a world size (2-4 real gloo ranks) and a short sequence of
calls, each with a fault and an arrival delay per rank; the calls are made back to back with
no synchronisation between them, as engines do. The ranks are long-lived (``rankset``): one
set per world size, started once for the module, so the examples are many and randomised
(hypothesis' own seed; ``print_blob`` prints the blob that replays a failure). Every call
uses a shape of its own (the example's ``hidden_dim``, the step's ``max_token_num``), so a
veto cached by an earlier call never answers a later one. The simulated device is the only
stand-in. Faults that kill a rank are the fault scenarios' (tests/faults.py), not this
property's: a long-lived set cannot lose a rank.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from faults import bound
from rankset import RankSet

T = 2.0
# examples per run (each one a few calls on 2-4 real ranks, ~0.5 s): 100 in the suite, more
# for a longer search (FIWS_PROPERTY_EXAMPLES=1000 pytest tests/ranks/test_agreement_property.py)
EXAMPLES = int(os.environ.get("FIWS_PROPERTY_EXAMPLES") or 100)
BOUND = bound(T)  # slack that scales with the vote timeout (the fault matrix's bound)
DELAYS = (0.0, 0.0, 0.05, 0.2)
# each fault: the reason code its rank's "no" carries, and the site of our code where it
# shows as an internal error (strict mode: that site only, on that rank only)
FAULTS = {
    "none": (None, None),
    "short": ("OUT_OF_MEMORY", None),
    "probe_error": ("PROBE_ERROR", "probe"),
    "facts_error": ("DRIVER_ERROR", "facts"),
    "bad_backend": ("ARG_MISMATCH", None),  # FlashInfer would reject it; its peers' differ
    "other_shape": ("ARG_MISMATCH", None),
    "world_size_1": ("ARG_MISMATCH", None),
}
DRAWN = ("none", "none", "none", "none", *[f for f in FAULTS if f != "none"])

HANDLER = """
import rank_lib
import strict
from flashinfer_safe_workspace.planning import probe as _probe
dev = rank_lib.setup(free_mb=None, vote_timeout=%(T)s, on_veto="raise")
real_facts = dev.facts

def broken(*a, **k):
    raise _probe.DriverQueryFailed("injected driver query failure")

def handle(case):
    out = []
    for i, step in enumerate(case["steps"]):
        delay, fault = step[RANK]
        dev.free_bytes, dev.error, dev.facts = 80 << 30, None, real_facts
        kwargs = dict(rank=RANK, world_size=WORLD, max_token_num=64 * (i + 1),
                      hidden_dim=case["hidden"])
        if fault == "short":
            dev.free_bytes = 1 << 20
        elif fault == "probe_error":
            dev.error = RuntimeError("injected probe error")
        elif fault == "facts_error":
            dev.facts = broken
        elif fault == "bad_backend":
            kwargs["backend"] = "bogus"
        elif fault == "other_shape":
            kwargs["hidden_dim"] = case["hidden"] + 8
        elif fault == "world_size_1":
            kwargs["world_size"] = 1
        time.sleep(delay)
        calls, seen = len(rank_lib.calls), len(strict.seen)
        outcome, secs, err = rank_lib.create(**kwargs)
        out.append({"created": len(rank_lib.calls) > calls, "outcome": outcome, "secs": secs,
                    "err": err[:600], "live": dev.live_bytes, "reasons": rank_lib.last_reasons,
                    "sites": strict.seen[seen:]})
    return out
""" % {"T": T}

_shapes = itertools.count()  # every example's hidden_dim is its own: 1024 + 16 n (+ 8: other_shape)


@pytest.fixture(scope="module")
def rank_sets():
    sets = {w: RankSet(w, HANDLER) for w in (2, 3, 4)}
    try:
        yield sets
    finally:
        for s in sets.values():
            s.close()


@st.composite
def _cases(draw):
    world = draw(st.sampled_from((2, 3, 4)))
    step = st.lists(st.tuples(st.sampled_from(DELAYS), st.sampled_from(DRAWN)),
                    min_size=world, max_size=world)
    return world, draw(st.lists(step, min_size=1, max_size=4))


def _check_step(i, step, got, settled):
    """The property for one call of the sequence (``got``: every rank's answer). ``settled``:
    the call before was clean and created everywhere, so no rank can still be on it."""
    faults = [f for _, f in step]
    if set(faults) == {"other_shape"}:  # the same other shape on every rank: a clean call
        faults = ["none"] * len(faults)
    codes = {FAULTS[f][0] for f in faults} - {None}
    mismatch = "ARG_MISMATCH" in codes  # the calls differ: a round may lack some ranks
    allowed = codes | {"ABORTED"} | ({"ABSENT"} if mismatch else set())
    if not settled:  # a rank may still be on the call before (another call, or absent)
        allowed |= {"ARG_MISMATCH", "ABSENT"}
    where = (i, step, got)
    created = [g["created"] for g in got]
    assert all(created) or not any(created), where
    rejected = set(faults) == {"bad_backend"}  # FlashInfer rejects the call on every rank
    if rejected:  # one register decides for all: FlashInfer's own error everywhere, or a veto
        assert len({g["outcome"] for g in got}) == 1, ("split", where)
    for rank, (g, fault) in enumerate(zip(got, faults)):
        code, site = FAULTS[fault]
        assert g["secs"] <= BOUND, where
        assert g["live"] == 0, where
        assert g["sites"] in ([], [site] if site else []), ("internal errors", rank, where)
        if not codes:
            if settled:  # nothing wrong, nobody behind: it must be created
                assert g["created"] and g["reasons"] == [], ("clean call", rank, where)
            continue
        assert not g["created"], where  # any fault anywhere: nobody creates
        if rejected:  # every rank passes through to FlashInfer's own error. Unless the call
            # before was not clean everywhere (not settled): a peer's board entry of its side
            # of that call (another call, done) can then read as "finished without us", and
            # the round is aborted as a mismatch before the pass is decided
            # (board.Watch._judge): vetoed on every rank, a rank that had read every record
            # naming the pass-through
            if settled or g["outcome"] == "error":
                assert g["outcome"] == "error" and "bogus" in g["err"], where
            else:
                reasons = set(g["reasons"] or ())
                assert g["outcome"] == "vetoed" and reasons, where
                assert reasons <= allowed | {"PASS_THROUGH"}, ("reasons", rank, allowed, where)
            continue
        assert g["outcome"] == "vetoed", where
        reasons = set(g["reasons"] or ())
        assert reasons and reasons <= allowed, ("reasons", rank, allowed, where)
        if code is not None and settled and not mismatch:  # the rank that said no names its
            # own reason, unless it arrived after the abort and followed it (then it names
            # the deciding rank's, which the register carries, or ABORTED)
            followed = "decided before this rank arrived" in (g["err"] or "")
            assert code in reasons or followed, ("own reason", rank, where)
    return not codes and all(created)


_settled: dict = {}  # rank set -> its last call was clean and created everywhere


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_cases())
def test_created_on_every_rank_or_on_none(rank_sets, case):
    world, steps = case
    rank_set = rank_sets[world]
    hidden = 1024 + 16 * next(_shapes)
    timeout = 30 + len(steps) * (max(DELAYS) + BOUND + 1)
    per_rank = rank_set.ask({"steps": steps, "hidden": hidden}, timeout=timeout)
    for rank, r in enumerate(per_rank):
        assert isinstance(r, list), (rank, r)  # else the rank's own exception
    settled = _settled.get((world, rank_set.started), True)  # a fresh set: nobody behind
    for i, step in enumerate(steps):
        settled = _check_step(i, step, [per_rank[r][i] for r in range(world)], settled)
    _settled[(world, rank_set.started)] = settled
