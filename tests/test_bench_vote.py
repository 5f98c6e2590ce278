"""bench/vote's own arithmetic: table, goals and PNG, on made-up figures (no ranks started)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import struct
import zlib
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "vote"


def _load():
    loader = importlib.machinery.SourceFileLoader("bench_vote", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_vote", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _cell(first, median, p90, outcome):
    return {"first_ms": first, "median_ms": median, "p90_ms": p90, "outcomes": [outcome]}


RESULTS = [{"world": 2, "pass": _cell(20.0, 2.0, 3.0, "pass"), "veto": _cell(30.0, 1.0, 2.0, "veto")},
           {"world": 8, "pass": _cell(60.0, 12.0, 15.0, "pass"), "veto": _cell(40.0, 8.0, 9.0, "veto")}]
OLD = {"results": [{"world": 2, "pass": {"median_ms": 1.0}, "veto": {"median_ms": 0.5}},
                   {"world": 8, "pass": {"median_ms": 24.0}, "veto": {"median_ms": 16.0}}]}


def test_table_puts_old_medians_and_ratios_beside_the_new():
    rows = _load().table(RESULTS, OLD).splitlines()
    assert len(rows) == 4
    assert rows[2].split("|")[1:-1] == [" 2 ", " 20.0 ", " 30.0 ", " 2.0 ", " 3.0 ", " 1.0 ", " 2.00 ",
                                        " 1.0 ", " 2.0 ", " 0.5 ", " 2.00 ", " pass: pass, veto: veto "]
    assert " 0.50 " in rows[3] and " 24.0 " in rows[3]
    assert "| - |" in _load().table(RESULTS, None)


def test_verdict_names_the_goals_that_are_missed():
    text = _load().verdict(RESULTS)
    assert "warm at 8 ranks" in text and "12.0 ms" in text and "NOT met on the median" in text
    assert "first call at 2 ranks (goal <= 50 ms): 30.0 ms (worse of pass/veto): met" in text
    assert "first call at 8 ranks (goal <= 50 ms): 60.0 ms (worse of pass/veto): NOT met" in text


def test_png_is_well_formed(tmp_path):
    mod = _load()
    path = tmp_path / "v.png"
    mod.plot(path, [2, 8], mod.series_for(RESULTS, OLD))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (n,), kind = struct.unpack(">I", data[8:12]), data[12:16]
    w, h = struct.unpack(">II", data[16:24])
    assert kind == b"IHDR" and n == 13
    (m,) = struct.unpack(">I", data[33:37])
    raw = zlib.decompress(data[41:41 + m])
    assert len(raw) == h * (1 + 3 * w)
    assert raw.count(bytes((214, 39, 40))) > 10  # the new veto series is drawn
