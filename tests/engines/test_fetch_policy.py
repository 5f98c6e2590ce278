"""Under ``CI=true`` an engine wheel that cannot be fetched fails the test (a green CI
always means the engine tables were checked); elsewhere it skips."""

from __future__ import annotations

import pytest

import _runner
import _wheels


def _unavailable(*args, **kwargs):
    raise _wheels.Unavailable("offline (simulated)")


@pytest.mark.parametrize("version", ["0.33.0", "0.22.0"])  # 0.22.0: the mode-1 run
@pytest.mark.parametrize("ci,outcome", [("true", pytest.fail.Exception),
                                        ("1", pytest.fail.Exception),
                                        ("", pytest.skip.Exception)])
def test_unfetchable_wheel_fails_under_ci(monkeypatch, ci, outcome, version):
    monkeypatch.setattr(_wheels, "fetch", _unavailable)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome) as info:
        _runner.engine_root("vllm", version)
    assert "could not be fetched" in str(info.value)
