"""Seeded histories of large groups (tests/model/simulate.py) over the package's own core:
a short pass here (the long one: ``scripts/simulate``, its figures in docs/testing.md).
Every history keeps every property of the checker; each seed replays exactly; together
the seeds reach every outcome the checker names."""

from __future__ import annotations

import pytest

from model import checker as K
from model import simulate as M

PASSES = [(8, range(40), (5, 25)), (16, range(8), (5, 25)), (72, range(2), (5, 8))]


@pytest.mark.parametrize("size,seeds,calls", PASSES, ids=[f"{p[0]} ranks" for p in PASSES])
def test_long_histories_keep_every_property(size, seeds, calls):
    seen = set()
    for seed in seeds:
        run = M.run(seed, size, calls)
        assert run.violations == [], (seed, run.violations[:3], run.trace[-30:])
        gone = run.faults["crash"] + run.faults["interrupt"]  # ranks that left mid-history
        assert sum(run.answers.values()) >= (size - gone) * 5  # it ran: every rank left answered
        seen |= run.seen
    assert "commit" in seen


def test_together_the_seeds_reach_every_outcome():
    seen = set()
    for size, seeds, calls in PASSES[:1]:
        for seed in seeds:
            seen |= M.run(seed, size, calls).seen
    assert seen == set(K.SOMETIMES)


def test_a_seed_replays_exactly():
    a, b = M.run(11, 8), M.run(11, 8)
    assert (a.trace, a.answers, a.faults, a.steps) == (b.trace, b.answers, b.faults, b.steps)
    assert M.run(12, 8).trace != a.trace


def test_the_fault_plan_is_fixed_by_the_seed():
    assert M.scenario(5, 8) == M.scenario(5, 8)
    kinds = {tuple(sorted(k for k, p in M.scenario(s, 8)[1].items() if p)) for s in range(60)}
    assert len(kinds) > 4  # different seeds activate different fault kinds
