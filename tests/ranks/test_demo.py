"""``python -m flashinfer_safe_workspace demo``: real local ranks over gloo, the real
wrapper and decision, a simulated device (no GPU here). The demo reports what the
decision logged (its decision line), read back with the documented parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashinfer_safe_workspace.planning.plan import MiB
from rank_lib import PLAN_BYTES

TIMEOUT = 180


def demo(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    proc = subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "demo", "--json",
                           "--mode", "simulated", "--world-size", "2", "--vote-timeout", "20",
                           *args], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, rows


def _plan_bytes() -> int:
    """The demo's call (trtllm, 2 ranks, 2048 x 4096 bf16) on FlashInfer 0.7.4: the bytes
    recorded on the H200 (tests/rank_lib.py, PLAN_BYTES), not the rules' own plan."""
    return PLAN_BYTES[2]


def test_a_starved_rank_vetoes_on_both_ranks():
    proc, rows = demo("--starve-rank", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["outcome"] == "None (vetoed)" and r["vote"] == "no"
        assert r["ranks"] == [0, 1]
        assert "rank 0 (cuda:0)" in r["reason"] and "OUT_OF_MEMORY" in r["reason"]
    # the starved rank planned and probed: its line's plan is the recorded bytes
    assert rows[0]["probe"] == "no" and rows[0]["plan_bytes"] == _plan_bytes()
    # its peer probed (the same plan) unless it arrived after the abort was written and
    # followed it without planning (then its line says so: no plan, no probe)
    assert (rows[1]["probe"], rows[1]["plan_bytes"]) in (("ok", _plan_bytes()), ("-", -1)), rows[1]
    # HEADROOM_MB=auto over the demo's gloo WORLD: the small reserve (64 MiB); the starved
    # rank is left --short-mb (default 64 MiB) short of plan + headroom
    headroom, short = 64 * MiB, 64 * MiB
    assert all(r["headroom_bytes"] == headroom for r in rows if r["probe"] != "-")
    assert rows[0]["free_bytes"] == _plan_bytes() + headroom - short


def test_with_room_everywhere_flashinfer_is_called_on_both():
    proc, rows = demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in rows:
        assert r["vote"] == "yes" and r["probe"] == "ok" and r["reason"] == ""
        # CPU only: FlashInfer itself is called and fails on its own (no CUDA here)
        assert r["outcome"].startswith(("created", "FlashInfer was called")), r["outcome"]


def test_text_says_flashinfer_s_own_error_after_a_pass_is_expected_without_a_gpu():
    """On a machine without a GPU the vote passes and FlashInfer's own function then fails;
    the text report says that this is expected (and that ``auto`` is the default answer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    proc = subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "demo",
                           "--mode", "simulated", "--world-size", "2", "--vote-timeout", "20"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert "on_veto=auto" in proc.stdout.splitlines()[0]
    ranks = [l for l in proc.stdout.splitlines() if l.startswith("  rank ")]
    assert len(ranks) == 2 and all("vote of ranks [0, 1]: yes" in l for l in ranks), proc.stdout
    if all("FlashInfer was called and raised" in l for l in ranks):  # no CUDA here
        assert "without a GPU its error is expected here" in proc.stdout, proc.stdout


def _text_demo(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    return subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "demo",
                           "--mode", "simulated", *args], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_a_rank_that_never_planned_shows_no_plan():
    """Issue 23, C5: a rank that followed a decision made without it (here the slow rank,
    arriving after its peer's timeout) printed "plan -0.0 MiB + headroom 0 MiB"."""
    proc = _text_demo("--world-size", "2", "--slow-rank", "1", "--vote-timeout", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [l for l in proc.stdout.splitlines() if l.startswith("  rank ")]
    assert len(ranks) == 2, proc.stdout
    assert "plan 134.0 MiB + headroom 64 MiB" in ranks[0]
    # since the speed change a late rank runs its own checks and probe before it follows
    # the decision it finds, so it may have a plan; never the -0.0 MiB of no plan at all
    assert "-0.0" not in proc.stdout, proc.stdout
    assert ("no plan (decided without it)" in ranks[1] and "MiB" not in ranks[1]
            or "plan 134.0 MiB + headroom 64 MiB" in ranks[1]), ranks[1]
    assert "vote of ranks [0, 1]: no" in ranks[1], ranks[1]


@pytest.mark.parametrize("args,rejects", [
    (("--backend", "mnnvl-cutedsl"), "Blackwell"),
    (("--backend", "mnnvl", "--max-token-num", "2147483647", "--hidden-dim", "2147483647"),
     "UINT32_MAX"),
])
def test_a_call_flashinfer_rejects_is_shown_not_an_internal_error(args, rejects):
    """Issue 23, C6: every rank ended with "internal error: 'PassThrough' object has no
    attribute 'peak_bytes'" and exit 1. Each rank now reports FlashInfer's own rejection,
    which the shim lets through on every rank, and the demo exits 0."""
    proc = _text_demo("--world-size", "2", "--vote-timeout", "20", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "internal error" not in out and "Traceback" not in out, out
    ranks = [l for l in proc.stdout.splitlines() if l.startswith("  rank ")]
    assert len(ranks) == 2, out
    for line in ranks:
        assert "FlashInfer rejects this call before allocating" in line and rejects in line
        assert "FlashInfer was called and raised" in line, line  # its own error, on each rank
    assert "the vote passed" not in proc.stdout  # no vote said yes to a plan here
