"""The PNG chart of bench/vote: standard library only (zlib + struct), drawn with a 3x5
pixel font at twice its size (upper case, digits, a little punctuation).

A chart carries its axis titles with units, a legend (colour, solid or dotted), the commit
its figures were measured at and the date of the run. y is logarithmic (0.1 ms .. 1000 ms),
x the group size on a log2 scale; an x tick label that would touch the one before it (64 and
72 ranks) drops to a second row.

``replot`` redraws a committed result file's chart from its JSON alone: the run's own
format (``decision``/``gloo``/``floor`` per scenario), the format of a2c79f1 (``median_ms``
and ``first_ms`` per scenario, the old gloo vote's medians beside it) and the old gloo
vote's own (``median_ms``/``p90_ms``).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

_GLYPHS = """
0 111101101101111|1 010110010010111|2 111001111100111|3 111001111001111|4 101101111001001
5 111100111001111|6 111100111101111|7 111001001001001|8 111101111101111|9 111101111001111
A 010101111101101|B 110101110101110|C 011100100100011|D 110101101101110|E 111100110100111
F 111100110100100|G 011100101101011|H 101101111101101|I 111010010010111|J 001001001101010
K 101101110101101|L 100100100100111|M 101111111101101|N 110101101101101|O 010101101101010
P 110101110100100|Q 010101101110011|R 110101110101101|S 011100010001110|T 111010010010010
U 101101101101111|V 101101101101010|W 101101111111101|X 101101010101101|Y 101101010010010
Z 111001010100111|. 000000000000010|, 000000000010100|: 000010000010000|- 000000111000000
+ 000010111010000|( 010100100100010|) 010001001001010|/ 001001010100100|' 010010000000000
_ 000000000000111|= 000111000111000|< 001010100010001|> 100010001010100
"""
FONT = {g.split()[0]: g.split()[1] for g in _GLYPHS.replace("\n", "|").split("|") if g.strip()}
CHAR_W, CHAR_H = 8, 10  # one glyph at twice its size, one pixel column apart
WIDTH, PLOT_X = 640, (64, 640 - 32)  # the image's width; the plot area's left and right

Y_TITLE = "SLOWEST RANK'S WALL TIME, MS (LOG SCALE)"
X_TITLE = "RANKS IN THE GROUP (LOG2 SCALE)"


class Canvas:
    """An RGB image with points, lines and text; written as a PNG."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.rows = [bytearray([255] * (w * 3)) for _ in range(h)]

    def put(self, x: int, y: int, c) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            self.rows[y][3 * x:3 * x + 3] = bytes(c)

    def line(self, x0, y0, x1, y1, c, dotted=False) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            if not dotted or (i // 3) % 2 == 0:
                self.put(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), c)

    def text(self, x: int, y: int, s: str, c=(0, 0, 0)) -> None:
        for ch in s.upper():
            for k, b in enumerate(FONT.get(ch, "0" * 15)):
                if b == "1":
                    for dx in (0, 1):
                        for dy in (0, 1):
                            self.put(x + 2 * (k % 3) + dx, y + 2 * (k // 3) + dy, c)
            x += CHAR_W

    def marker(self, x: int, y: int, c) -> None:
        for dx in range(-2, 3):
            for dy in range(-2, 3):
                self.put(x + dx, y + dy, c)

    def write(self, path: Path) -> None:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind, data):
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                         + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def x_scale(xs: list, left: int, right: int):
    """Ranks to pixels: log2, the first x at ``left`` and the last at ``right``."""
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    return lambda x: left + int((math.log2(x) - lx0) * (right - left) / max(lx1 - lx0, 1e-9))


def tick_rows(xs: list, px) -> list:
    """``(label, left x, row)`` for each x tick: row 1 where the label would touch the one
    before it on row 0 (64 and 72 ranks on a log2 axis)."""
    out, ends = [], {0: -10 ** 9, 1: -10 ** 9}
    for x in xs:
        label = str(x)
        x0 = px(x) - CHAR_W * len(label) // 2
        row = 0 if x0 >= ends[0] + CHAR_W // 2 else 1
        out.append((label, x0, row))
        ends[row] = x0 + CHAR_W * len(label)
    return out


def _x_ticks(cv: Canvas, xs: list, px, y: int) -> int:
    """Tick marks and labels under the axis; returns the y below the lowest row used."""
    rows = 1
    for x, (label, x0, row) in zip(xs, tick_rows(xs, px)):
        cv.line(px(x), y - 8, px(x), y - 4 + 6 * row, (0, 0, 0))
        cv.text(x0, y + (CHAR_H + 4) * row, label)
        rows = max(rows, row + 1)
    return y + (CHAR_H + 4) * rows


def _wrap(text: str, width: int) -> list:
    """``text`` in lines of at most ``width`` characters, broken after a comma."""
    lines, line = [], ""
    for part in text.split(", "):
        joined = f"{line}, {part}" if line else part
        if line and len(joined) > width:
            lines.append(line + ",")
            joined = part
        line = joined
    return lines + [line]


def plot(path: Path, xs: list, series: dict, colours: dict, dotted, note: str) -> None:
    """One chart: ``series`` (label -> one y per x, in ms) against ``xs`` (ranks)."""
    legend_rows = (len(series) + 1) // 2
    w, plot_h = WIDTH, 260
    notes = _wrap(note, (w - 16) // CHAR_W)
    top = 6 + len(notes) * (CHAR_H + 4) + CHAR_H + 16
    # ticks (two rows at most), the x title, the legend
    h = top + plot_h + 8 + 2 * (CHAR_H + 4) + 2 + CHAR_H + 16 + legend_rows * (CHAR_H + 6) + 4
    (left, right), bottom = PLOT_X, top + plot_h
    cv = Canvas(w, h)
    for i, text in enumerate(notes):
        cv.text(8, 6 + i * (CHAR_H + 4), text)
    cv.text(8, 6 + len(notes) * (CHAR_H + 4) + 6, Y_TITLE)
    lo, hi = -1.0, 3.0  # log10 ms
    px = x_scale(xs, left, right)
    py = lambda ms: bottom - int((min(max(math.log10(max(ms, 1e-3)), lo), hi) - lo)  # noqa: E731
                                 * (bottom - top) / (hi - lo))
    for dec in range(int(lo), int(hi) + 1):  # grid and labels: 0.1 1 10 100 1000 ms
        y = py(10.0 ** dec)
        cv.line(left, y, right, y, (225, 225, 225))
        label = f"{10.0 ** dec:g}"
        cv.text(left - 6 - CHAR_W * len(label), y - 5, label)
    cv.line(left, bottom, right, bottom, (0, 0, 0))
    cv.line(left, top, left, bottom, (0, 0, 0))
    y = _x_ticks(cv, xs, px, bottom + 8)
    cv.text((left + right - CHAR_W * len(X_TITLE)) // 2, y + 2, X_TITLE)
    for label, ys in series.items():
        c = colours[label]
        for i in range(len(ys) - 1):
            cv.line(px(xs[i]), py(ys[i]), px(xs[i + 1]), py(ys[i + 1]), c, label in dotted)
        for x, v in zip(xs, ys):
            cv.marker(px(x), py(v), c)
            if v > 10.0 ** hi:  # off the scale: its value beside the clipped point
                cv.text(px(x) - 8 - CHAR_W * len(f"{v:.0f}"), top + 4, f"{v:.0f}", c)
    y += CHAR_H + 16
    for i, label in enumerate(series):
        lx, ly = 8 + (i % 2) * (w // 2), y + (i // 2) * (CHAR_H + 6)
        cv.line(lx, ly + 4, lx + 24, ly + 4, colours[label], label in dotted)
        cv.line(lx, ly + 5, lx + 24, ly + 5, colours[label], label in dotted)
        cv.marker(lx + 12, ly + 4, colours[label])
        cv.text(lx + 32, ly, label)
    cv.write(path)


def note_for(meta: dict) -> str:
    """The chart's provenance line: the commit of its figures, the date and machine of the
    run."""
    commit = meta.get("commit") or meta.get("commit_note") or "none recorded"
    return f"COMMIT {commit}, RUN {meta.get('date', '?')}, {meta.get('machine', '?')}"


# --------------------------------------------------------------------------- replot

LEGACY_COLOURS = {"new pass, warm median": (31, 119, 180), "new veto, warm median": (214, 39, 40),
                  "new pass, first call": (44, 160, 44), "new veto, first call": (148, 103, 189),
                  "old pass, median (gloo)": (140, 180, 215),
                  "old veto, median (gloo)": (240, 160, 160),
                  "pass, median (gloo)": (31, 119, 180), "veto, median (gloo)": (255, 127, 14),
                  "pass, p90 (gloo)": (44, 160, 44), "veto, p90 (gloo)": (214, 39, 40)}
LEGACY_DOTTED = ("new pass, first call", "new veto, first call", "old pass, median (gloo)",
                 "old veto, median (gloo)", "pass, p90 (gloo)", "veto, p90 (gloo)")


def legacy_series(results: list, old: dict | None) -> dict:
    """The series of a result file written before the baselines were measured."""
    if all("first_ms" in r["pass"] for r in results):  # a2c79f1: the store protocol
        s = {"new pass, warm median": [r["pass"]["median_ms"] for r in results],
             "new veto, warm median": [r["veto"]["median_ms"] for r in results],
             "new pass, first call": [r["pass"]["first_ms"] for r in results],
             "new veto, first call": [r["veto"]["first_ms"] for r in results]}
        by_world = {r["world"]: r for r in (old or {}).get("results", [])}
        if all(r["world"] in by_world for r in results):
            s["old pass, median (gloo)"] = [by_world[r["world"]]["pass"]["median_ms"] for r in results]
            s["old veto, median (gloo)"] = [by_world[r["world"]]["veto"]["median_ms"] for r in results]
        return s
    return {"pass, median (gloo)": [r["pass"]["median_ms"] for r in results],  # the gloo vote
            "veto, median (gloo)": [r["veto"]["median_ms"] for r in results],
            "pass, p90 (gloo)": [r["pass"]["p90_ms"] for r in results],
            "veto, p90 (gloo)": [r["veto"]["p90_ms"] for r in results]}


def replot(json_path: Path, series_for, colours: dict, dotted, old: Path | None = None,
           commit_note: str | None = None) -> Path:
    """Redraw ``<json>.png`` from the committed ``<json>.json``; ``series_for`` is the run's
    own (bench/vote's) for its current format."""
    doc = json.loads(Path(json_path).read_text())
    results, meta = doc["results"], dict(doc["meta"])
    if commit_note and not meta.get("commit"):
        meta["commit_note"] = commit_note
    if all("decision" in r.get("pass", r.get("veto", {})) for r in results):
        series = series_for(results)
    else:
        series = legacy_series(results, json.loads(old.read_text()) if old else None)
        colours, dotted = LEGACY_COLOURS, LEGACY_DOTTED
    out = Path(json_path).with_suffix(".png")
    plot(out, [r["world"] for r in results], series, colours, dotted, note_for(meta))
    return out
