"""Run real multi-process torch.distributed (gloo) groups for tests, bounded in time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import strict

HERE = Path(__file__).resolve().parent
MARK = "FIWS_RESULT "

PRELUDE = """
import strict; strict.install()
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
RANK = int(os.environ["FIWS_TEST_RANK"]); WORLD = int(os.environ["FIWS_TEST_WORLD"])
dist.init_process_group(os.environ.get("FIWS_TEST_BACKEND", "gloo"), init_method="tcp://127.0.0.1:" + os.environ["FIWS_TEST_PORT"],
                        rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
result = {"rank": RANK}
"""

EPILOGUE = """
print("FIWS_RESULT " + json.dumps(result, default=str), flush=True)
# every rank stays until every rank has reported (bounded): a rank that finishes early never
# takes the store or its end of a group's connections away from a peer still deciding or
# still building a group (gloo's connectFullMesh needs every peer up). Rank 0 hosts the
# store: it leaves last, once every other rank has said it is leaving.
try:
    _st = dist.distributed_c10d._get_default_store()
    _linger = datetime.timedelta(seconds=float(os.environ.get("FIWS_LINGER_S", "30")))
    _st.set(f"harness/done/{RANK}", "1")
    _st.wait([f"harness/done/{r}" for r in range(WORLD)], _linger)
    if RANK == 0:
        _st.wait([f"harness/left/{r}" for r in range(1, WORLD)], _linger)
    else:
        _st.set(f"harness/left/{RANK}", "1")
except Exception:
    pass
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    # never the working tree's package: the current directory stays off sys.path (3.11+),
    # so every child imports the installed wheel (tests/test_installed.py checks it)
    env["PYTHONSAFEPATH"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_ranks(world: int, body: str, *, timeout: float = 90.0, env: dict | None = None,
              rank_env: dict | None = None, internal_errors=()) -> list[dict]:
    """Start ``world`` ranks running PRELUDE + body + EPILOGUE; return one dict per rank:
    ``{"rank", "result" (dict or None), "returncode", "stderr", "wall_s", "internal_errors"}``.

    Strict mode (tests/strict.py): an internal error reported by a rank at a site not in
    ``internal_errors`` fails here (``None``: the caller checks them itself)."""
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world):
        e = clean_env(**(env or {}))
        e.update(FIWS_TEST_RANK=str(rank), FIWS_TEST_WORLD=str(world), FIWS_TEST_PORT=str(port))
        e.update({k: str(v) for k, v in (rank_env or {}).get(rank, {}).items()})
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=e, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for rank, proc in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, stderr = proc.communicate()
        line = next((l for l in stdout.splitlines() if l.startswith(MARK)), None)
        out.append({"rank": rank, "result": json.loads(line[len(MARK):]) if line else None,
                    "returncode": proc.returncode, "stderr": stderr[-int(os.environ.get("FIWS_STDERR_TAIL", "3000")):],
                    "wall_s": time.monotonic() - start,
                    "internal_errors": strict.sites_in(stderr)})
    for r in out:
        strict.check(r["internal_errors"], internal_errors, f"rank {r['rank']}")
    return out


def results(runs: list[dict]) -> list[dict]:
    """The per-rank result dicts; fail with every rank's stderr if one is missing."""
    missing = [r for r in runs if r["result"] is None]
    if missing:
        raise AssertionError("ranks without a result:\n" + "\n".join(
            f"--- rank {r['rank']} rc={r['returncode']}\n{r['stderr']}" for r in missing))
    return [r["result"] for r in runs]


def run_python(code: str, *, env: dict | None = None, args=(), timeout: float = 60.0):
    """A fresh interpreter running ``code``; returns CompletedProcess."""
    return subprocess.run([sys.executable, *args, "-c", code], env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)
