"""bench/success-path on the CPU (``--fake``): the whole orchestration with real ranks.

Fresh pairs of rank processes (gloo, the installed shim activated by its ``.pth`` with
``FLASHINFER_SAFE_WORKSPACE=1``, FlashInfer's real unified function, a simulated device
behind the probe, a stand-in for the TRTLLM workspace constructor). The figures mean
nothing here; the shape of the JSON and the on/off bookkeeping do.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "success-path"


def _load():
    loader = importlib.machinery.SourceFileLoader("bench_success_path", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_success_path", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_fake_run_writes_both_modes_interleaved(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--fake", "--reps", "2", "--later", "2",
                        "--timeout", "120", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "success-path.json").read_text())
    assert data["failed"] == []
    assert data["meta"]["fake"] is True and data["meta"]["flashinfer"] not in ("", "-")
    assert data["meta"]["commit"] and data["meta"]["date"]
    assert [r["order"] for r in data["reps"]] == [["on", "off"], ["off", "on"]]
    for rep in data["reps"]:
        on, off = rep["on"], rep["off"]
        for fig in (on, off):
            assert fig["first_ms"] > 0 and len(fig["later_ms"]) == 2 and fig["problems"] == []
            assert len(fig["ranks"]) == 2
        # the shim decided every creation with it on, and was not even imported with it off
        assert on["decision_first_ms"] > 0 and len(on["decision_later_ms"]) == 2
        assert off["decision_first_ms"] is None and off["decision_later_ms"] == []
        assert all(r["shim_file"] for r in on["ranks"])
        assert not any(r["shim_file"] for r in off["ranks"])
    s = data["summary"]
    assert s["reps_with_both"] == 2 and s["on"]["pairs"] == s["off"]["pairs"] == 2
    for key in ("first_paired_diff_ms", "later_paired_diff_ms", "first_diff_of_medians_ms",
                "later_diff_of_medians_ms"):
        assert isinstance(s[key], float)
    md = (tmp_path / "success-path.md").read_text()
    assert "| first creation, median (ms) |" in md and "FAKE" in md
    assert "only 2 reps ran both modes" in md


def _report(rank, decisions, shim=True):
    rows = [{"i": i, "wall_ms": 10.0 + i + rank, "created": True, "decisions": d}
            for i, d in enumerate(decisions)]
    return {"rank": rank, "rows": rows, "shim_loaded": shim, "wrapped": shim,
            "device": "d", "flashinfer": "0.7.4", "torch": "t",
            "shim_file": "x" if shim else None, "free_start": None, "free_end": None}


def test_pair_figures_take_the_slowest_rank_and_flag_a_silent_shim():
    mod = _load()
    good = [_report(r, [[["pass", 3.0 + r]], [["pass", 1.0]], [["pass", 2.0]]]) for r in (0, 1)]
    fig = mod.pair_figures(good, on=True)
    assert fig["problems"] == []
    assert fig["first_ms"] == 11.0 and fig["later_ms"] == [12.0, 13.0]
    assert fig["decision_first_ms"] == 4.0 and fig["decision_later_ms"] == [1.0, 2.0]
    silent = [_report(r, [[], [], []]) for r in (0, 1)]  # on, but no decision line
    assert len(mod.pair_figures(silent, on=True)["problems"]) == 6
    leaked = [_report(r, [[], [], []], shim=True) for r in (0, 1)]  # off, yet the shim loaded
    assert len(mod.pair_figures(leaked, on=False)["problems"]) == 2


def test_summary_pairs_each_rep():
    mod = _load()

    def fig(first, later):
        return {"first_ms": first, "later_ms": later, "later_median_ms": sorted(later)[1],
                "decision_first_ms": 1.0, "decision_later_ms": [0.5]}
    reps = [{"rep": 1, "on": fig(110.0, [12, 13, 14]), "off": fig(100.0, [10, 11, 12])},
            {"rep": 2, "on": fig(130.0, [20, 21, 22]), "off": fig(128.0, [20, 20, 20])},
            {"rep": 3, "on": fig(120.0, [11, 11, 11])}]  # its off pair failed
    s = mod.summary(reps)
    assert s["reps_with_both"] == 2
    assert s["first_paired_diff_ms"] == 6.0  # median of +10 and +2
    assert s["on"]["first_median_ms"] == 120.0 and s["off"]["first_median_ms"] == 114.0
    assert s["later_paired_diff_ms"] == 1.5  # median of +2 and +1
    text = "\n".join(mod.verdict(s, 3))
    assert "first creation: on - off +6.0 ms" in text and "NOT met" in text
    assert "only 2 reps ran both modes" in text


def test_a_pair_past_its_timeout_is_killed():
    mod = _load()
    limit = 1.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past"):
        mod.run_pair(True, 1, limit, fake=True)
    assert time.monotonic() - start < limit + 15  # the kill's own wait is at most 10 s
