"""bench/vote's charts (bench/_chart.py): the committed PNGs are what the generator draws
from the committed JSON, and a chart carries what a reader needs (axis titles with units, a
legend, the commit and date) with no tick label drawn over another."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


def _vote():
    sys.path.insert(0, str(BENCH))
    loader = importlib.machinery.SourceFileLoader("bench_vote_chart", str(BENCH / "vote"))
    spec = importlib.util.spec_from_loader("bench_vote_chart", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _pixels(path: Path) -> tuple:
    data = path.read_bytes()
    w, h = struct.unpack(">II", data[16:24])
    (m,) = struct.unpack(">I", data[33:37])
    raw = zlib.decompress(data[41:41 + m])
    return w, h, [raw[y * (1 + 3 * w) + 1:(y + 1) * (1 + 3 * w)] for y in range(h)]


# how each committed chart was drawn: its JSON, the old figures beside it, the commit note
CHARTS = {"h200-16core-vote": (None, None),
          "vote": ("vote-old-gloo.json", None),
          "vote-old-gloo": (None, "none recorded (first committed in 92bc84f)")}


@pytest.mark.parametrize("stem", sorted(CHARTS))
def test_committed_chart_is_drawn_from_its_json(stem, tmp_path):
    """Redrawing from the committed JSON gives the committed PNG pixel for pixel (a generator
    change must regenerate them: `bench/vote --replot`). Pixels, not bytes: another zlib may
    compress the same image differently."""
    mod = _vote()
    old, note = CHARTS[stem]
    shutil.copy(RESULTS / f"{stem}.json", tmp_path / f"{stem}.json")
    out = mod._chart.replot(tmp_path / f"{stem}.json", mod.series_for, mod.COLOURS, mod.DOTTED,
                            RESULTS / old if old else None, note)
    assert _pixels(out) == _pixels(RESULTS / f"{stem}.png")


def test_64_and_72_rank_ticks_do_not_overlap():
    chart = _vote()._chart
    xs = [2, 8, 16, 32, 64, 72]
    ticks = chart.tick_rows(xs, chart.x_scale(xs, *chart.PLOT_X))
    rows = {label: row for label, _, row in ticks}
    assert rows["64"] != rows["72"]
    for row in (0, 1):
        boxes = sorted((x0, x0 + chart.CHAR_W * len(label)) for label, x0, r in ticks if r == row)
        assert all(a[1] <= b[0] for a, b in zip(boxes, boxes[1:])), boxes
    # evenly spread ticks stay on one row
    assert {r for _, _, r in chart.tick_rows([2, 4, 8, 16], chart.x_scale([2, 4, 8, 16], 64, 608))} == {0}


def test_chart_has_note_titles_and_a_legend(tmp_path):
    mod = _vote()
    chart = mod._chart
    meta = {"commit": "4d56ca0", "date": "2026-12-02 05:36 UTC", "machine": "x86_64, 16 cores"}
    assert chart.note_for(meta) == "COMMIT 4d56ca0, RUN 2026-12-02 05:36 UTC, x86_64, 16 cores"
    assert chart.note_for({"date": "d", "machine": "m"}) == "COMMIT none recorded, RUN d, m"
    assert chart.Y_TITLE.endswith("MS (LOG SCALE)") and "RANKS" in chart.X_TITLE
    long = "COMMIT none recorded (first committed in 92bc84f), RUN 2026-11-29 18:51 UTC, x86_64, 2 cores"
    lines = chart._wrap(long, 78)
    assert len(lines) == 2 and all(len(l) <= 78 for l in lines) and " ".join(lines) == long
    assert all(ch in chart.FONT for ch in (chart.Y_TITLE + chart.X_TITLE + long.upper()).replace(" ", ""))
    series = {"decision pass, warm median": [2.0, 20.0], "store floor, warm median": [0.2, 1.5]}
    path = tmp_path / "c.png"
    mod.plot(path, [2, 72], series, meta)
    w, h, rows = _pixels(path)
    legend = rows[h - 45:]  # below the x title: the legend
    for label in series:
        assert sum(row.count(bytes(mod.COLOURS[label])) for row in legend) >= 20, label
    drawn = lambda rs: sum(1 for row in rs for i in range(0, len(row), 3) if row[i] == 0)  # noqa: E731
    assert drawn(rows[:16]) > 100  # the note line is written
    mod.plot(path, [2, 72], series, dict(meta, commit="1234567"))
    assert _pixels(path)[2][:16] != rows[:16]  # and it is the commit's
