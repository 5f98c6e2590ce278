"""Python 3.10–3.13: the stdlib-only parts (pre-gate, bootstrap, settings, plans) run on every
interpreter this machine has, without torch, wrapt or FlashInfer installed there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2]

CODE = r"""
import json, os, sys
os.environ["FLASHINFER_SAFE_WORKSPACE"] = "1"
line = open(sys.argv[1]).read()
exec(line)  # the .pth line itself: imports the package, which only inserts a watcher
import flashinfer_safe_workspace as f
from flashinfer_safe_workspace import _config; from flashinfer_safe_workspace.activation import bootstrap as _bootstrap; from flashinfer_safe_workspace.planning import plan as _plan; from flashinfer_safe_workspace.planning import rules
s = _config.read_settings({"FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB": "64",
                           "FLASHINFER_SAFE_WORKSPACE_ON_VETO": "RAISE"})
plan = rules.plan_for(_plan.Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16"),
                      _plan.Facts(), "0.7.4")
print(json.dumps({"installed": f.is_installed(), "watching": _bootstrap.watching(),
                  "heavy": [m for m in ("wrapt", "torch", "flashinfer") if m in sys.modules],
                  "headroom": s.headroom_mb, "on_veto": s.on_veto, "peak": plan.peak_bytes,
                  "version": sys.version_info[:2]}))
"""


def _interpreter(minor: int):
    """python3.MINOR from PATH, or from pyenv's versions folder (its PATH shims refuse
    versions that are not selected)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python3.{minor}")]
    candidates += sorted(str(p) for p in root.glob(f"3.{minor}.*/bin/python3"))
    for exe in filter(None, candidates):
        try:
            probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                   capture_output=True, text=True, timeout=300)
        except OSError:
            continue
        if probe.returncode == 0:
            return exe
    return None


@pytest.mark.parametrize("minor", [10, 12, 13])
def test_stdlib_parts_on_other_pythons(minor):
    exe = _interpreter(minor)
    if exe is None:
        pytest.skip(f"no runnable python3.{minor} on this machine")
    pth = SRC / "flashinfer_safe_workspace.pth"
    proc = subprocess.run([exe, "-S", "-c", CODE, str(pth)], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == [3, minor]
    assert out["installed"] and out["watching"] and out["heavy"] == []
    assert (out["headroom"], out["on_veto"]) == (64, "raise")
    assert out["peak"] == 140509308  # E1 on 0.7.4: 34 + 2 + 98 MiB and the small tails
