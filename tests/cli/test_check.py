"""``python -m flashinfer_safe_workspace check``: exit 0 fits, 1 does not, 2 cannot tell.

The 0/1 paths use the hidden ``--simulate-free-mb`` (a SimulatedDevice with that many
free bytes: CI has no GPU); everything above the probe is the real code. Exit 2 is
tested for real: this machine has no CUDA driver.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from flashinfer_safe_workspace.planning import facts as _facts, probe as _probe, rules
from flashinfer_safe_workspace import cli as _cli

from flashinfer_safe_workspace.planning.plan import MiB

TIMEOUT = 120
SHAPE = ["--backend", "trtllm", "--world-size", "8", "--max-token-num", "2048",
         "--hidden-dim", "4096", "--dtype", "bfloat16"]


def check(capsys, *args):
    code = _cli.main(["check", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def plan_peak(capsys, *shape) -> int:
    assert _cli.main(["plan", "--json", *shape]) == 0
    return json.loads(capsys.readouterr().out)["peak_bytes"]


def test_fits_with_plenty_of_memory(capsys):
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", str(80 * 1024))
    assert code == 0 and r["status"] == "fits" and r["exit_code"] == 0
    assert r["probe_ok"] is True
    assert r["peak_bytes"] == plan_peak(capsys, *SHAPE)  # the same plan as `plan`
    assert r["headroom_left_bytes"] == 80 * 1024 * MiB - r["peak_bytes"] - 512 * MiB


def test_check_reports_the_facts_it_used(capsys):
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", str(80 * 1024))
    pad, source = _facts.signal_pad()
    assert r["facts"]["torch_signal_pad"] == pad
    assert r["facts"]["torch_signal_pad_source"] == source
    assert r["facts"]["granularity"] == 2 * MiB and r["facts"]["source"] == "simulated cuda:0"
    assert _cli.main(["check", *SHAPE, "--simulate-free-mb", str(80 * 1024)]) == 0
    assert f"torch signal pad {pad} B" in capsys.readouterr().out


def test_check_plans_torch_symmetric_memory_with_the_real_pad(capsys, monkeypatch):
    """trtllm under confidential compute is allocator C on 0.7.4: its blocks carry
    torch's signal pad, the same pad ``plan`` uses by default."""
    shape = ["--backend", "trtllm", "--world-size", "8", "--max-token-num", "91",
             "--hidden-dim", "2880", "--dtype", "float32"]
    monkeypatch.setenv("FLASHINFER_CONFIDENTIAL_COMPUTE", "1")
    code, r = check(capsys, *shape, "--flashinfer-version", "0.7.4",
                    "--simulate-free-mb", "100000")
    assert code == 0 and r["plan"]["allocator"] == "C", r
    assert _cli.main(["plan", "--json", "--flashinfer-version", "0.7.4", *shape,
                      "--confidential-compute"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert r["peak_bytes"] == planned["peak_bytes"]
    assert r["facts"]["torch_signal_pad"] == planned["facts"]["torch_signal_pad"] \
        == _facts.signal_pad()[0]


def test_exact_boundary_of_plan_plus_headroom(capsys):
    peak = plan_peak(capsys, *SHAPE)
    # the simulated device holds every plan allocation plus the headroom at once;
    # free space in whole MiB: the smallest that fits, and one less
    need_mb = math.ceil((peak + 512 * MiB) / MiB)
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", str(need_mb))
    assert code == 0, r
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", str(need_mb - 1))
    assert code == 1 and r["status"] == "does-not-fit"
    assert r["headroom_left_bytes"] < 0
    assert "headroom" in r["reason"] and "CUDA_ERROR_OUT_OF_MEMORY" in r["reason"]


def test_headroom_option_moves_the_boundary(capsys):
    peak = plan_peak(capsys, *SHAPE)
    free_mb = math.ceil(peak / MiB) + 100
    assert check(capsys, *SHAPE, "--simulate-free-mb", str(free_mb))[0] == 1  # 512 MiB default
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", str(free_mb), "--headroom-mb", "64")
    assert code == 0 and r["headroom_bytes"] == 64 * MiB


def test_headroom_default_follows_the_environment(monkeypatch, capsys):
    from flashinfer_safe_workspace import _config

    monkeypatch.setenv("FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB", "32")
    _config.reload()
    try:
        code, r = check(capsys, *SHAPE, "--simulate-free-mb", "100000")
        assert r["headroom_bytes"] == 32 * MiB
    finally:
        monkeypatch.delenv("FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB")
        _config.reload()


def test_plan_itself_too_big_fails_on_a_buffer(capsys):
    code, r = check(capsys, *SHAPE, "--simulate-free-mb", "100")
    assert code == 1
    assert "trtllm.buffer" in r["reason"] or "trtllm.lamport" in r["reason"]


def test_mnnvl_backend_and_fp32(capsys):
    shape = ["--backend", "mnnvl", "--world-size", "4", "--max-token-num", "1024",
             "--hidden-dim", "7168", "--dtype", "float32"]
    code, r = check(capsys, *shape, "--simulate-free-mb", "200000")
    assert code == 0 and r["plan"]["backend"] == "mnnvl"
    assert r["peak_bytes"] == plan_peak(capsys, *shape)


def test_rejected_arguments_cannot_tell(capsys):
    # mnnvl buffer over UINT32_MAX: FlashInfer raises before allocating
    code, r = check(capsys, "--backend", "mnnvl", "--world-size", "8", "--max-token-num",
                    "1000000", "--hidden-dim", "8192", "--simulate-free-mb", "100000")
    assert code == 2 and r["status"] == "cannot-tell"
    assert "rejects" in r["reason"]


def test_release_without_rules_cannot_tell(capsys):
    code, r = check(capsys, *SHAPE, "--flashinfer-version", "0.4.0", "--simulate-free-mb", "1000")
    assert code == 2 and "0.4.0" in r["reason"]


def test_no_driver_cannot_tell_for_real():
    """No simulation: this machine has no CUDA driver, so the answer is 2."""
    try:
        _probe.CudaProber().driver()
        pytest.skip("this machine has a CUDA driver")
    except _probe.ProbeUnavailable:
        pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    proc = subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "check", *SHAPE],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot-tell (exit 2)" in proc.stdout
    assert "CUDA" in proc.stdout


def test_exit_codes_through_the_module_entry_point():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    base = [sys.executable, "-m", "flashinfer_safe_workspace", "check", *SHAPE]
    ok = subprocess.run(base + ["--simulate-free-mb", "100000"], env=env, capture_output=True,
                        text=True, timeout=TIMEOUT)
    short = subprocess.run(base + ["--simulate-free-mb", "600"], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert short.returncode == 1, short.stdout + short.stderr
    assert "peak held" in ok.stdout and "result: fits (exit 0)" in ok.stdout
    assert "result: does-not-fit (exit 1)" in short.stdout


def test_simulate_option_is_hidden_from_help(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert "--headroom-mb" in out and "--simulate-free-mb" not in out



# --------------------------------------------------------------------------- plan


def plan_json(capsys, *args):
    code = _cli.main(["plan", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def creates(doc) -> list:
    return [a["bytes"] for a in doc["allocations"] if a["api"] == "cuMemCreate"]


MNNVL_SMALL = ["--flashinfer-version", "0.7.4", "--backend", "mnnvl", "--world-size", "4",
               "--max-token-num", "777", "--hidden-dim", "1", "--dtype", "float16"]


def test_plan_rounds_a_2_mib_mnnvl_buffer_to_2_mib_not_512(capsys):
    """Issue 11: 0.7.4 mnnvl, ws 4, T 777, H 1, fp16. Without a GPU the H200 rule
    applies per object size: the 2 MiB buffer keeps a 2 MiB multicast granularity."""
    for facts in ([], ["--facts", "h200"]):
        code, doc = plan_json(capsys, *MNNVL_SMALL, *facts)
        assert code == 0 and doc["allocator"] == "B4"
        if facts or doc["facts"]["source"].startswith("H200"):
            assert creates(doc) == [2 * MiB]
            assert doc["facts"]["multicast_granularity_by_size"] == {str(2 * MiB): 2 * MiB}
    # one granularity for every object, as before, when asked for
    code, doc = plan_json(capsys, *MNNVL_SMALL, "--facts", "h200",
                          "--multicast-granularity", str(512 * MiB))
    assert creates(doc) == [512 * MiB] and doc["facts"]["multicast_rule"] == "fixed"


def test_plan_rounds_a_larger_mnnvl_buffer_to_512_mib_on_h200(capsys):
    code, doc = plan_json(capsys, *MNNVL_SMALL[:-4], "--hidden-dim", "4096",
                          "--dtype", "bfloat16", "--facts", "h200")
    assert code == 0 and creates(doc) == [512 * MiB]


LEGACY_FP32 = ["--flashinfer-version", "0.7.4", "--entry", "legacy", "--world-size", "8",
               "--max-token-num", "91", "--hidden-dim", "2880", "--dtype", "float32"]


def test_plan_uses_the_installed_torch_signal_pad(capsys):
    """Issue 11: 0.7.4 legacy default path (torch symmetric memory), ws 8, T 91,
    H 2880, fp32: 10 + 2 + 26 MiB with torch's pad of 9216; 8 + 2 + 24 MiB with 2048."""
    pad, source = _facts.signal_pad()
    code, doc = plan_json(capsys, *LEGACY_FP32)
    assert code == 0 and doc["allocator"] == "C"
    assert doc["facts"]["torch_signal_pad"] == pad
    assert doc["facts"]["torch_signal_pad_source"] == source
    if pad == 9216:
        assert creates(doc) == [10 * MiB, 2 * MiB, 26 * MiB]
    code, doc = plan_json(capsys, *LEGACY_FP32, "--signal-pad", "9216")
    assert creates(doc) == [10 * MiB, 2 * MiB, 26 * MiB]
    code, doc = plan_json(capsys, *LEGACY_FP32, "--signal-pad", "2048")
    assert creates(doc) == [8 * MiB, 2 * MiB, 24 * MiB]
    assert doc["facts"]["torch_signal_pad_source"] == "--signal-pad"


def test_plan_text_prints_the_facts(capsys):
    assert _cli.main(["plan", *LEGACY_FP32, "--signal-pad", "4096"]) == 0
    out = capsys.readouterr().out
    assert "peak held" in out and "torch signal pad 4096 B (--signal-pad)" in out


def test_plan_says_when_flashinfer_is_missing(capsys, monkeypatch):
    """No silent 0.7.4: without FlashInfer and without --flashinfer-version, exit 2."""
    monkeypatch.setattr(rules, "flashinfer_version", lambda: None)
    code = _cli.main(["plan", "--backend", "trtllm"])
    captured = capsys.readouterr()
    assert code == 2 and "FlashInfer is not installed" in captured.err
    assert captured.out == ""
    assert _cli.main(["plan", "--flashinfer-version", "0.7.4"]) == 0


def test_plan_driver_facts_without_a_driver_cannot_tell(capsys):
    try:
        _probe.CudaProber().driver()
        pytest.skip("this machine has a CUDA driver")
    except _probe.ProbeUnavailable:
        pass
    code = _cli.main(["plan", *MNNVL_SMALL, "--facts", "driver"])
    assert code == 2 and "--facts driver" in capsys.readouterr().err


def test_console_script_entry_point_is_the_cli():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts")
             if e.name == "flashinfer-safe-workspace"]
    assert ep.load() is _cli.main
