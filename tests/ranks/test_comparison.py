"""The agreement runs the cross-rank checks it is handed (issue 24, M4): ``agreement.vote``
imports no ``checks``; ``_decide`` hands ``checks.compare`` over at its import; without a
comparison the vote fails closed (a no with INTERNAL_ERROR), never a yes.

Each case runs in a fresh interpreter, so "nothing handed in yet" is the real state of a
process that imported the agreement alone, not a patched global."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import flashinfer_safe_workspace

PKG = Path(flashinfer_safe_workspace.__file__).resolve().parent

SCRIPT = r"""
import json, os, sys
from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace import _veto as explain
from flashinfer_safe_workspace.agreement import vote
from flashinfer_safe_workspace.agreement.record import YES, Candidate, CheckResult, Record

def records(versions):
    return [Record(rank=i, pid=1, position=i, call="c", args={"x": 1},
                   candidates={"-": Candidate(YES, plan_digest="p")},
                   checks={"packages": CheckResult(True, R.OK, f"flashinfer={v}")})
            for i, v in enumerate(versions)]

def answer(versions):
    recs = records(versions)
    v = vote.resolve(recs)
    return {"commit": v.commit, "why": v.why, "check": v.check,
            "reasons": list(explain.verdict_reasons(v, recs)),
            "checks_loaded": "flashinfer_safe_workspace.checks" in sys.modules}

out = {"alone_differ": answer(["0.6.1", "0.6.2"]), "alone_same": answer(["0.6.1", "0.6.1"])}
from flashinfer_safe_workspace import _decide  # hands checks.compare to the agreement
out["decide_differ"] = answer(["0.6.1", "0.6.2"])
out["decide_same"] = answer(["0.6.1", "0.6.1"])
if hasattr(os, "fork"):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child inherits the handed-in comparison
        os.write(w, json.dumps(answer(["0.6.1", "0.6.2"])).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    out["child_differ"] = json.loads(os.read(r, 65536))
print(json.dumps(out))
"""


def _run():
    proc = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "FLASHINFER_SAFE_WORKSPACE": "0"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_vote_fails_closed_until_a_comparison_is_handed_in():
    out, stderr = _run()
    for case in ("alone_differ", "alone_same"):  # even records that would all agree
        got = out[case]
        assert got["commit"] is False, got
        assert "no cross-rank comparison" in got["why"], got
        assert got["reasons"] == [flashinfer_safe_workspace._reasons.INTERNAL_ERROR], got
        assert got["checks_loaded"] is False, got  # the agreement did not reach for checks
    assert "internal error in vote.compare" in stderr  # one warning, named by its site


def test_decide_hands_checks_compare_over_and_a_forked_child_keeps_it():
    out, _ = _run()
    assert out["decide_same"]["commit"] is True, out["decide_same"]
    for case in ("decide_differ", "child_differ"):
        if case not in out:
            continue  # no fork on this platform
        got = out[case]
        assert got["commit"] is False and got["check"] == "packages", got
        assert got["reasons"] == [flashinfer_safe_workspace._reasons.PACKAGE_MISMATCH], got


def test_one_owner_hands_the_comparison_over():
    """``use_comparison`` has one caller in the package: ``_decide``, at module level."""
    callers = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "use_comparison"):
                callers.append(path.relative_to(PKG).as_posix())
    assert callers == ["_decide.py"]
    top = ast.parse((PKG / "_decide.py").read_text(encoding="utf-8")).body
    assert any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
               and getattr(n.value.func, "attr", "") == "use_comparison" for n in top)
