"""Start the ranks of one engine run (``engine_rank.py``), bounded, and collect their JSON;
check a verified outcome against the table in ``docs/engines.md``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DOC = HERE.parent.parent / "docs" / "engines.md"
TIMEOUT = 240


def engine_root(dist: str, version: str) -> Path:
    from _engines import ENGINES
    from _wheels import Unavailable, fetch

    try:
        return fetch(dist, version, ENGINES[(dist, version)])
    except Unavailable as exc:
        pytest.skip(f"{dist}=={version} could not be fetched from PyPI: {exc}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(dist: str, version: str, root: Path, free_mb, on_veto: str, **env_extra):
    """One process per rank; returns their reports, rank order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env.update({"FLASHINFER_SAFE_WORKSPACE": "1", "FLASHINFER_SAFE_WORKSPACE_ON_VETO": on_veto,
                "FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"})
    env.update(env_extra)
    port = str(_port())
    world = str(len(free_mb))
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "engine_rank.py"), dist, version, str(root), str(rank),
         world, port, on_veto, str(free)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, free in enumerate(free_mb)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT)
            lines = [l for l in out.splitlines() if l.startswith("{")]
            assert proc.returncode == 0 and lines, f"rank exited {proc.returncode}:\n{err[-3000:]}"
            report = json.loads(lines[-1])
            assert "crashed" not in report, report.get("traceback")
            reports.append(report)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return reports


def messages(report, logger_prefix: str, level: str = "WARNING"):
    return [r["msg"] for r in report["records"]
            if r["logger"].startswith(logger_prefix) and r["level"] == level]


_ROW = re.compile(r"^\|\s*(?P<engine>[^|]+?)\s*\|\s*(?P<release>[^|]+?)\s*\|[^|]*\|"
                  r"\s*`(?P<none>[^`]+)`[^|]*\|\s*`(?P<raise>[^`]+)`")


def doc_outcomes() -> dict:
    """``(engine, release) -> {"none": key, "raise": key}`` from the verified table."""
    table = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            table[(m["engine"].strip(), m["release"].strip())] = {
                "none": m["none"].strip(), "raise": m["raise"].strip()}
    return table


def check_doc(engine: str, release: str, mode: str, observed: str) -> None:
    """The docs table states exactly what this run observed."""
    row = doc_outcomes().get((engine, release))
    assert row is not None, f"docs/engines.md has no verified row for {engine} {release}"
    assert row[mode] == observed, (
        f"docs/engines.md says {engine} {release} ON_VETO={mode}: `{row[mode]}`, "
        f"observed `{observed}`")
