"""Start the ranks of one engine run (``engine_rank.py``), bounded, and collect their JSON;
check a verified outcome against the table in ``docs/engines.md``."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402
import strict  # noqa: E402

DOC = HERE.parent.parent / "docs" / "engines.md"
TIMEOUT = 240


def engine_root(dist: str, version: str) -> Path:
    from _engines import ENGINES
    from _wheels import Unavailable, fetch

    try:
        return fetch(dist, version, ENGINES[(dist, version)])
    except Unavailable as exc:
        why = f"{dist}=={version} could not be fetched from PyPI: {exc}"
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(why + " (CI=true: the engine tables must be checked, not skipped)")
        pytest.skip(why)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = ("none", "raise", "auto")
_RUNS: dict = {}


# The releases whose ranks are fresh interpreters, activated by the installed ``.pth`` at
# start-up exactly as in production (the variable set before Python starts, the shim waiting
# for the first ``import flashinfer``). Every other run forks its ranks from the fork server
# of tests/harness.py (torch and FlashInfer imported once), which makes the ``.pth`` line's
# own call, ``gate.from_pth()``, before the rank's script runs: the same activation function,
# with FlashInfer already imported (the engine's own files are still imported after it).
FRESH = {("vllm", "0.33.0")}


def run_ranks(dist: str, version: str, root: Path, free_mb, modes=MODES, **env_extra):
    """One process per rank, every mode in turn inside the same pair of processes (the
    first activated by the variable and the ``.pth`` line, the next ones by ``uninstall()``
    and ``install(on_veto=...)``); returns ``{mode: [report of rank 0, rank 1, ...]}``.
    Memoized: the tests of one release and its three modes share one run."""
    key = (dist, version, str(root), tuple(free_mb), tuple(modes), tuple(sorted(env_extra.items())))
    if key in _RUNS:
        return _RUNS[key]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env.update({"FLASHINFER_SAFE_WORKSPACE": "1", "FLASHINFER_SAFE_WORKSPACE_ON_VETO": modes[0],
                "FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"})
    env.update(env_extra)
    port = str(_port())
    world = str(len(free_mb))
    fresh = (dist, version) in FRESH
    procs = [harness.start_file(
        HERE / "engine_rank.py", [dist, version, root, rank, world, port, ",".join(modes), free],
        env, fresh=fresh) for rank, free in enumerate(free_mb)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT)
            lines = [l for l in out.splitlines() if l.startswith("{")]
            assert proc.returncode == 0 and lines, f"rank exited {proc.returncode}:\n{err[-3000:]}"
            strict.check(strict.sites_in(err), (), f"{dist} {version} rank {len(reports)}")
            reports.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    by_mode = {}
    for mode in modes:
        ranks = [r["modes"][mode] for r in reports]
        for r in ranks:
            assert "crashed" not in r, r.get("traceback")
        by_mode[mode] = ranks
    _RUNS[key] = by_mode
    return by_mode


def messages(report, logger_prefix: str, level: str = "WARNING"):
    return [r["msg"] for r in report["records"]
            if r["logger"].startswith(logger_prefix) and r["level"] == level]


_ROW = re.compile(r"^\|\s*(?P<engine>[^|]+?)\s*\|\s*(?P<release>[^|]+?)\s*\|[^|]*\|"
                  r"\s*`(?P<none>[^`]+)`[^|]*\|\s*`(?P<raise>[^`]+)`[^|]*\|\s*`(?P<auto>[^`]+)`")


def doc_outcomes() -> dict:
    """``(engine, release) -> {"none": key, "raise": key, "auto": key}`` from the verified
    table of ``docs/engines.md``."""
    table = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m and m["engine"].strip() != "Engine":
            table[(m["engine"].strip(), m["release"].strip())] = {
                mode: m[mode].strip() for mode in MODES}
    return table


def check_doc(engine: str, release: str, mode: str, observed: str) -> None:
    """The docs table states exactly what this run observed."""
    row = doc_outcomes().get((engine, release))
    assert row is not None, f"docs/engines.md has no verified row for {engine} {release}"
    assert row[mode] == observed, (
        f"docs/engines.md says {engine} {release} ON_VETO={mode}: `{row[mode]}`, "
        f"observed `{observed}`")


def check_answers(reports, mode: str, caller: str, legacy: bool = False) -> None:
    """What ``_caller.resolve`` answered on every rank for every vetoed call (the legacy
    tuple-returning entry always raises)."""
    want = "raise" if legacy else {"none": "none", "raise": "raise", "auto": "raise"}[mode]
    for r in reports:
        assert r["answers"], "no vetoed call reached the resolver"
        for a in r["answers"]:
            assert a["kind"] == want and a["caller"] == caller, a
