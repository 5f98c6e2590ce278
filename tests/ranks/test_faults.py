"""The fault matrix (tests/faults.py) as tests: decision on every rank, time to return,
nothing left held on the simulated device."""

import pytest

import faults


@pytest.mark.parametrize("scenario", faults.SCENARIOS, ids=[s.name for s in faults.SCENARIOS])
def test_fault(scenario):
    runs = faults.run(scenario)
    scenario.verify(runs)


@pytest.mark.parametrize("scenario", faults.scale_scenarios(faults.SCALE_CI),
                         ids=[s.name for s in faults.scale_scenarios(faults.SCALE_CI)])
def test_fault_at_scale(scenario):
    runs = faults.run(scenario)
    scenario.verify(runs)
