"""The capture-state reader (``planning.probe.capturing``) that mode 10's check reads: what
torch's CUDA runtime says about the current stream, False without CUDA or on an error.
torch's CUDA queries are replaced by answers set per test (this machine has no GPU)."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import checks
from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace.checks import capture
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice


@pytest.fixture
def cuda(monkeypatch):
    import torch

    state = {"available": True, "capturing": False}

    def capturing():
        if isinstance(state["capturing"], BaseException):
            raise state["capturing"]
        return state["capturing"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["available"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    return state


@pytest.mark.parametrize("available,capturing,expected", [
    (True, True, True), (True, False, False), (False, True, False),
    (True, RuntimeError("no context"), False)])
def test_the_reader(cuda, available, capturing, expected):
    cuda.update(available=available, capturing=capturing)
    assert _probe.capturing() is expected


def test_the_check_sees_a_real_capture_through_the_device_facts(cuda):
    """A capture the simulated facts do not set still reaches the check: the facts read
    the real reader."""
    cuda.update(capturing=True)
    from unit.facts import ctx

    facts = SimulatedDevice(1 << 30).rank_facts()
    assert facts.capturing is True
    res = checks.run_one(capture, ctx(facts=facts))
    assert (res.code, res.value) == (R.CAPTURING, "capturing=1")
    cuda.update(capturing=False)
    assert SimulatedDevice(1 << 30).rank_facts().capturing is False
