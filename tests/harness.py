"""Run real multi-process torch.distributed (gloo) groups for tests, bounded in time.

Ranks are real processes, each its own interpreter state, forked from a fork server that has
imported torch and FlashInfer once (``multiprocessing``'s forkserver, started with the same
clean environment a fresh rank gets): importing both costs every fresh interpreter seconds of
CPU, most of the suite's time on a small machine. Our package is never imported before the
fork. ``FIWS_TEST_FORK=0``, or an environment that switches the shim on at interpreter
start-up (``FLASHINFER_SAFE_WORKSPACE`` set), starts fresh interpreters instead.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
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
# Polled, not a blocking wait: torch warns "waitForInput ... timed out" on stderr when a
# blocking wait ends at its timeout (a dead peer), and tests/ranks/test_faults.py asserts
# that no rank's stderr has that warning from our own store connections.
def _await(keys, linger):
    end = time.monotonic() + linger
    while time.monotonic() < end and not _st.check(keys):
        time.sleep(0.02)
try:
    _st = dist.distributed_c10d._get_default_store()
    _linger = float(os.environ.get("FIWS_LINGER_S", "30"))
    _st.set(f"harness/done/{RANK}", "1")
    _await([f"harness/done/{r}" for r in range(WORLD)], _linger)
    if RANK == 0:
        _await([f"harness/left/{r}" for r in range(1, WORLD)], _linger)
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
    # so every child imports the installed wheel (tests/package/test_installed.py checks it)
    env["PYTHONSAFEPATH"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


PRELOAD = ["torch", "torch.distributed", "flashinfer.comm"]
_ctx = None


def _forkserver():
    """The fork server's context, started once with a clean environment and PRELOAD."""
    global _ctx
    if _ctx is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        try:  # the server inherits the environment it is started in: a rank's clean one
            os.environ.clear()
            os.environ.update(clean_env())
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _ctx = ctx
    return _ctx


def _rank_main(script: str, env: dict, out_path: str, err_path: str) -> None:
    """In a forked rank: this rank's environment, stdout/stderr to its files, then ``script``
    as ``python -c`` would run it."""
    import builtins
    import signal

    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8",
                                  line_buffering=True)
    for sig, handler in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, signal.SIG_DFL), (signal.SIGCHLD, signal.SIG_DFL)):
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(env)
    if isinstance(script, tuple):  # (path, argv): ``python PATH ARGV...``
        import runpy

        path, argv = script
        sys.argv = [path, *argv]
        if "FLASHINFER_SAFE_WORKSPACE" in env:  # what the installed .pth line would call
            __import__("flashinfer_safe_workspace.activation.gate").activation.gate.from_pth()
        runpy.run_path(path, run_name="__main__")
    else:
        sys.argv = ["-c"]
        code = compile(script, "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})  # noqa: S102 - the test's own script
    sys.stdout.flush()


class _Forked:
    """A forked rank with the part of ``subprocess.Popen`` that run_ranks uses."""

    def __init__(self, script: str, env: dict):
        self._dir = tempfile.TemporaryDirectory(prefix="fiws-rank-")
        self._out, self._err = (os.path.join(self._dir.name, n) for n in ("out", "err"))
        self._proc = _forkserver().Process(target=_rank_main, args=(script, env, self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self):
        return self._proc.exitcode

    def kill(self):
        if self._proc.exitcode is None:
            self._proc.kill()

    def poll(self):
        return self._proc.exitcode

    def communicate(self, timeout=None):
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        try:
            return tuple(Path(p).read_text(errors="replace") for p in (self._out, self._err))
        finally:
            self._dir.cleanup()


def start_file(path, argv, env: dict, *, fresh: bool = False):
    """``python PATH ARGV...`` with ``env``: forked from the fork server (its ``.pth`` line's
    call, ``gate.from_pth()``, made first when the switch is in ``env``: torch and FlashInfer
    are already imported there, so the shim wraps at once instead of waiting for the first
    ``import flashinfer``), or with ``fresh`` (or ``FIWS_TEST_FORK=0``) a fresh interpreter
    whose installed ``.pth`` runs at start-up. A ``subprocess.Popen``-like handle, text mode."""
    argv = [str(a) for a in argv]
    if fresh or os.environ.get("FIWS_TEST_FORK", "1") == "0":
        return subprocess.Popen([sys.executable, str(path), *argv], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return _Forked((str(path), argv), env)


def _shell_signals() -> None:
    """In a fresh rank before it runs: SIGINT as a shell leaves it (Python then raises
    KeyboardInterrupt on it), whatever the test process ignores (a pytest-xdist worker may
    have SIGINT ignored; a child inherits an ignored signal across exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(script: str, env: dict):
    if os.environ.get("FIWS_TEST_FORK", "1") == "0" or "FLASHINFER_SAFE_WORKSPACE" in env:
        return subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=_shell_signals)
    return _Forked(script, env)


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
        procs.append(_start(script, e))
    out = []
    for rank, proc in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, stderr = proc.communicate(timeout=30)
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


def run_python(code: str, *, env: dict | None = None, args=(), timeout: float = 300.0):
    """A fresh interpreter running ``code``; returns CompletedProcess."""
    return subprocess.run([sys.executable, *args, "-c", code], env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)
