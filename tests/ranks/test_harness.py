"""The rank harness itself: a forked rank is what a fresh ``python -c`` rank would be where
the tests can tell (its environment, the package it imports, its signal handlers, its output
and exit status), and the fault points cost nothing when no hook is installed."""

from pathlib import Path

import pytest

import harness

BODY = """
import signal
import flashinfer_safe_workspace as fiws
result.update(file=fiws.__file__, env=sorted(k for k in os.environ if k.startswith("FIWS_X")),
              sigint=signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              argv=sys.argv, ours=sorted(k for k in os.environ if k.startswith("FLASHINFER_SAFE")))
print("to stdout"); sys.stderr.write("to stderr\\n")
"""


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_sees_its_own_environment_and_the_installed_package(fork, monkeypatch):
    monkeypatch.setenv("FIWS_TEST_FORK", fork)
    monkeypatch.setenv("FIWS_X_PARENT_ONLY", "1")  # the parent's environment reaches a rank,
    monkeypatch.setenv("FLASHINFER_SAFE_WORKSPACE_DEBUG", "1")  # but never our variables
    runs = harness.run_ranks(2, BODY, env={"FIWS_X_ALL": "1"}, rank_env={1: {"FIWS_X_ONE": "1"}})
    rs = harness.results(runs)
    import flashinfer_safe_workspace as fiws

    for r in rs:  # the package this process imports (tests/package/test_installed.py: the wheel)
        assert Path(r["file"]).resolve() == Path(fiws.__file__).resolve(), r["file"]
        assert r["sigint"] is True and r["argv"] == ["-c"] and r["ours"] == []
    assert rs[0]["env"] == ["FIWS_X_ALL", "FIWS_X_PARENT_ONLY"]
    assert rs[1]["env"] == ["FIWS_X_ALL", "FIWS_X_ONE", "FIWS_X_PARENT_ONLY"]
    for run in runs:
        assert run["returncode"] == 0 and "to stderr" in run["stderr"]


def test_a_forked_rank_reports_its_exit_status_and_a_signal():
    runs = harness.run_ranks(2, "if RANK == 1:\n    os.kill(os.getpid(), 9)\nresult['x'] = 1\n",
                             env={"FIWS_LINGER_S": "1"})
    assert runs[1]["returncode"] == -9 and runs[1]["result"] is None
    assert runs[0]["result"] == {"rank": 0, "x": 1}


def test_a_fault_point_calls_the_hook_only_when_installed():
    from flashinfer_safe_workspace import _points

    seen = []
    _points.hit("probe")
    assert _points.after(5, "probe") == 5 and seen == []
    _points.install(seen.append)
    try:
        _points.hit("probe")
        assert _points.after(7, "round.acked") == 7
    finally:
        _points.install(None)
    assert seen == ["probe", "round.acked"]
