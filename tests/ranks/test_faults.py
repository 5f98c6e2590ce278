"""The fault matrix (tests/faults.py) as tests: decision on every rank, time to return,
nothing left held on the simulated device; and torch's store warning ``waitForInput ...
timed out`` on no rank of any scenario (docs/agreement.md, "The store, and torch's
warnings": it can only come from a store that does not answer one operation of ours for our
connections' own timeout, at least 300 s; no scenario stops the store that long: the ones
here stop it for 2 s, or for a vote timeout or two)."""

import pytest

import faults


def _no_store_warning(scenario, runs):
    for r in runs:
        assert "waitForInput" not in r["stderr"], (r["rank"], r["stderr"][-1500:])


@pytest.mark.parametrize("scenario", faults.SCENARIOS, ids=[s.name for s in faults.SCENARIOS])
def test_fault(scenario):
    runs = faults.run(scenario)
    scenario.verify(runs)
    _no_store_warning(scenario, runs)


@pytest.mark.parametrize("scenario", faults.scale_scenarios(faults.SCALE_CI),
                         ids=[s.name for s in faults.scale_scenarios(faults.SCALE_CI)])
def test_fault_at_scale(scenario):
    runs = faults.run(scenario)
    scenario.verify(runs)
    _no_store_warning(scenario, runs)
