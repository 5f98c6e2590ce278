"""Every subcommand fed a table of bad inputs, each in a fresh interpreter: never a
traceback, a message naming what is wrong, and the documented exit code (2: refused or
cannot tell; ``cli/main.py``'s docstring and docs/operating.md, "Commands")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import clean_env

REFUSED = 2

BAD = [
    # plan
    ("plan --granularity 0", "--granularity"),
    ("plan --granularity 3", "power of two"),
    ("plan --multicast-granularity 0 --backend mnnvl", "--multicast-granularity"),
    ("plan --signal-pad -1", "--signal-pad"),
    ("plan --signal-pad -4096", "--signal-pad"),
    ("plan --max-token-num -5", "--max-token-num"),
    ("plan --max-token-num 99999999999", "--max-token-num"),
    ("plan --world-size 0", "--world-size"),
    ("plan --rank 2 --world-size 2", "--rank 2"),
    ("plan --rank -1", "--rank"),
    ("plan --hidden-dim abc", "--hidden-dim"),
    ("plan --flashinfer-version abc", "--flashinfer-version"),
    ("plan --flashinfer-version 0.4.0", "0.4.0"),
    ("plan --backend nope", "--backend"),
    ("plan --dtype int8", "--dtype"),
    ("plan --device -1", "--device"),
    ("plan --facts gpu", "--facts"),
    ("plan --granularity 1", "at least 4096"),
    ("plan --multicast-granularity 2048 --backend mnnvl", "--multicast-granularity"),
    ("plan --granularity 4294967296", "--granularity"),
    ("plan --entry legacy --backend mnnvl", "--entry legacy"),
    ("plan --use-symm-dev-mem", "--use-symm-dev-mem"),
    ("plan --entry bogus", "--entry"),
    ("plan --flashinfer-version 1.2.3.4.5", "--flashinfer-version"),
    # check
    ("check", "--default-shape"),
    ("check --world-size 2 --simulate-free-mb 100", "--max-token-num"),
    ("check --default-shape --headroom-mb -1", "--headroom-mb"),
    ("check --default-shape --rank 5", "--rank 5"),
    ("check --default-shape --device -1", "--device"),
    ("check --default-shape --simulate-free-mb -3", "--simulate-free-mb"),
    ("check --default-shape --flashinfer-version 0.4.0 --simulate-free-mb 100", "0.4.0"),
    ("check --default-shape --world-size 0", "--world-size"),
    # demo
    ("demo --world-size 0", "--world-size"),
    ("demo --world-size 65", "at most 64"),
    ("demo --starve-rank 5", "--starve-rank 5"),
    ("demo --die-rank 2", "--die-rank 2"),
    ("demo --slow-rank -1", "--slow-rank"),
    ("demo --vote-timeout 0", "--vote-timeout"),
    ("demo --vote-timeout nan", "--vote-timeout"),
    ("demo --vote-timeout -1", "--vote-timeout"),
    ("demo --short-mb -1", "--short-mb"),
    ("demo --on-veto maybe", "--on-veto"),
    ("demo --mode tpu", "--mode"),
    ("demo --mode gpu --world-size 64", "one CUDA GPU per rank"),  # no host here has 64
    ("demo --world-size two", "--world-size"),
    # doctor and the top level
    ("doctor --bogus", "--bogus"),
    ("doctor extra", "extra"),
    ("", "required"),
    ("frobnicate", "frobnicate"),
]


def cli(line: str, timeout: float = 120.0):
    return subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", *line.split()],
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("line,names", BAD, ids=[b[0] or "(none)" for b in BAD])
def test_bad_input_is_refused_clearly(line, names):
    proc = cli(line)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == REFUSED, (proc.returncode, out)
    assert names in out, out  # argparse and plan say it on stderr, check in its report


GOOD = [  # (arguments, exit code, words the output must hold)
    ("--version", 0, "flashinfer-safe-workspace 0."),
    ("plan --flashinfer-version 0.7.4", 0, "peak held"),
    ("plan --flashinfer-version 0.5.0", 2, "rejects this call"),  # no unified API there
    ("plan --flashinfer-version 0.7.4 --entry legacy --use-symm-dev-mem", 0, "peak held"),
    ("check --default-shape --simulate-free-mb 100000", 0, "fits"),
    ("check --default-shape --simulate-free-mb 10", 1, "does-not-fit"),
]


@pytest.mark.parametrize("line,code,words", GOOD, ids=[g[0] for g in GOOD])
def test_documented_exit_codes(line, code, words):
    proc = cli(line)
    assert "Traceback" not in proc.stderr and proc.returncode == code, proc.stderr
    assert words in proc.stdout + proc.stderr


def test_plan_warns_on_an_unmirrored_release_and_says_verified():
    proc = cli("plan --flashinfer-version 0.9.0 --json")
    assert proc.returncode == 0, proc.stderr
    assert "0.9.0 is newer than the newest release mirrored" in proc.stderr
    assert json.loads(proc.stdout)["verified"] is False
    mirrored = cli("plan --flashinfer-version 0.7.4 --json")
    assert json.loads(mirrored.stdout)["verified"] is True and "warning" not in mirrored.stderr


def test_help_shows_defaults_and_hides_internal_commands():
    top = cli("--help")
    assert top.returncode == 0 and "_demo-rank" not in top.stdout
    assert "exit codes" in top.stdout
    plan = cli("plan --help").stdout
    assert "(default: 2)" in plan and "(default: 2048)" in plan and "(default: 4096)" in plan
    check = cli("check --help").stdout
    assert "--default-shape" in check and "required unless --default-shape" in check
    demo = cli("demo --help").stdout
    assert "{auto,none,raise}" in demo and "(default: auto)" in demo
