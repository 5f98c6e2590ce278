"""bench/vote's own arithmetic: table, goals and PNG, on made-up figures (no ranks started)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import struct
import zlib
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vote"


def _load():
    loader = importlib.machinery.SourceFileLoader("bench_vote", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_vote", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _stat(first, median, p90):
    return {"first_ms": first, "median_ms": median, "p90_ms": p90, "max_ms": p90}


def _cell(outcome, decision, floor, gloo):
    return {"outcomes": [outcome], "decision": _stat(*decision), "floor": _stat(*floor),
            "gloo": _stat(*gloo), "decision_over_floor_median": decision[1] / floor[1]}


RESULTS = [{"world": 2, "pass": _cell("pass", (20.0, 2.0, 3.0), (0.5, 0.25, 0.3), (1.0, 0.5, 0.6)),
            "veto": _cell("veto", (30.0, 1.0, 2.0), (0.5, 0.25, 0.3), (1.0, 0.5, 0.6))},
           {"world": 72, "pass": _cell("pass", (60.0, 12.0, 15.0), (5.0, 4.0, 5.0), (12.0, 11.0, 12.0)),
            "veto": _cell("veto", (40.0, 8.0, 9.0), (5.0, 4.0, 5.0), (12.0, 11.0, 12.0))}]


def test_table_puts_the_baselines_and_ratios_beside_the_decision():
    rows = _load().table(RESULTS).splitlines()
    assert len(rows) == 4
    assert rows[2].split("|")[1:-1] == [" 2 ", " 0.50 ", " 0.25 ", " 2.00 ", " 3.00 ", " 8.0x ", " 4.0x ",
                                        " 2.5 ms: met ", " 20.00 ", " 1.00 ", " 30.00 ",
                                        " pass: pass, veto: veto "]
    assert " 10.0 ms: NOT met " in rows[3] and " 3.0x " in rows[3]


def test_verdict_names_the_goals_that_are_missed():
    text = _load().verdict(RESULTS)
    assert "warm at 2 ranks (goal <= 2 x floor + 2 ms = 2.5 ms): median 2.0 ms: met" in text
    assert "warm at 72 ranks (goal <= 2 x floor + 2 ms = 10.0 ms): median 12.0 ms: NOT met" in text
    assert "first decision at 72 ranks (goal <= 25 ms): 60.0 ms (worse of the scenarios): NOT met" in text


def test_png_is_well_formed(tmp_path):
    mod = _load()
    path = tmp_path / "v.png"
    series = mod.series_for(RESULTS)
    assert series["goal: 2 x floor + 2 ms"] == [2.5, 10.0]
    mod.plot(path, [2, 72], series)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (n,), kind = struct.unpack(">I", data[8:12]), data[12:16]
    w, h = struct.unpack(">II", data[16:24])
    assert kind == b"IHDR" and n == 13
    (m,) = struct.unpack(">I", data[33:37])
    raw = zlib.decompress(data[41:41 + m])
    assert len(raw) == h * (1 + 3 * w)
    assert raw.count(bytes((214, 39, 40))) > 10  # the veto series is drawn
    assert raw.count(bytes((127, 127, 127))) > 10  # the store floor is drawn


@pytest.mark.slow
def test_a_real_two_rank_run_counts_every_phase(tmp_path):
    """bench/vote itself, 2 real gloo ranks, 2 warm rounds, --count-ops: it finishes, both
    scenarios give their outcome, and the breakdown names every phase (the bench wraps the
    package's own steps by name: a step renamed in the package must be renamed here)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "2", "--reps", "2",
                           "--count-ops", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-2000:]
    data = json.loads((tmp_path / "vote-ops.json").read_text())
    text = json.dumps(data)
    for phase in ("facts", "checks", "plan", "probe", "agreement"):
        assert f'"{phase}' in text, phase
    table = (tmp_path / "vote-ops.md").read_text()
    assert "| 2 | pass |" in table and "| 2 | veto |" in table, table
