"""Every subcommand fed a table of bad inputs, each in a fresh interpreter: never a
traceback, a message naming what is wrong, and the documented exit code (2: refused or
cannot tell; ``cli/main.py``'s docstring and docs/operating.md, "Commands")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    ("plan --granularity 2199023255552", "at most 1099511627776"),  # 2^41
    ("plan --entry legacy --backend mnnvl", "--entry legacy"),
    ("plan --use-symm-dev-mem", "--use-symm-dev-mem"),
    ("plan --entry bogus", "--entry"),
    ("plan --flashinfer-version 0.7.4postpost", "PEP 440"),
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


@pytest.mark.parametrize("version", ["0.7.4.post1", "0.7.4rc1", "0.7.3", "0.7.2.post2", "0.6.19"])
def test_plan_of_a_release_not_read_is_not_verified(version):
    """Issue 23, C2: these said "verified": true with no warning (only major.minor.micro was
    compared); they are planned, warned about, and not verified."""
    proc = cli(f"plan --flashinfer-version {version} --json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verified"] is False
    assert f"warning: FlashInfer {version} is" in proc.stderr and "UNKNOWN_VERSION" in proc.stderr


@pytest.mark.parametrize("version", ["0.6.11.post2", "0.7.2.post1", "0.6.16.post4"])
def test_plan_of_a_release_read_stays_verified(version):
    proc = cli(f"plan --flashinfer-version {version} --json")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["verified"] is True


def test_values_above_int_max_name_the_upper_bound():
    """Issue 23, C1: 2^31 said "must be at least 1"."""
    for flag in ("--max-token-num", "--hidden-dim", "--world-size"):
        proc = cli(f"plan {flag} 2147483648")
        assert proc.returncode == REFUSED, proc.stderr
        assert f"argument {flag}: must be at most 2147483647, got 2147483648" in proc.stderr
        assert "at least" not in proc.stderr
    assert "must be at least 1, got 0" in cli("plan --max-token-num 0").stderr
    top = cli(f"plan --flashinfer-version 0.7.4 --max-token-num {2**31 - 1}")
    assert "must be" not in top.stderr and "Traceback" not in top.stderr  # the bound is valid
    assert top.returncode == 0 or "rejects this call" in top.stdout, top.stdout + top.stderr


@pytest.mark.parametrize("value,planned", [("4294967296", True), ("1099511627776", True),
                                           ("2199023255552", False), ("4294967295", False)])
def test_granularity_accepts_every_power_of_two_in_range(value, planned):
    """Issue 23, C1: 4294967296 (2^32, a power of two) was refused as "must be at least 1"."""
    proc = cli(f"plan --flashinfer-version 0.7.4 --granularity {value} --json")
    if planned:
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["facts"]["granularity"] == int(value)
        assert all(a["bytes"] % int(value) == 0 for a in doc["allocations"]
                   if a["api"] == "cuMemCreate")
    else:
        assert proc.returncode == REFUSED
        assert "power of two of at least 4096 and at most 1099511627776" in proc.stderr, proc.stderr


@pytest.mark.parametrize("line", ["plan --max-token-num 2147483648", "plan --rank 2",
                                  "check --default-shape --device -1", "demo --mode tpu",
                                  "doctor --bogus", "frobnicate", ""])
def test_a_refusal_is_one_line_with_a_pointer_to_help(line):
    """Issue 23, C3: the whole usage block (13-20 lines) came before the useful line."""
    proc = cli(line)
    assert proc.returncode == REFUSED and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "error: " in lines[0], proc.stderr
    assert "usage:" not in proc.stderr and "--help)" in lines[0]


@pytest.mark.parametrize("line,prog", [
    ("doctor --bogus", "doctor"), ("plan --flashinfer-version 0.7.4 extra", "plan"),
    ("check --default-shape --simulate-free-mb 1 --nope", "check"), ("demo --zz", "demo"),
    ("--bogus doctor", ""),  # before any subcommand: the top level's
])
def test_an_unknown_argument_is_refused_by_the_subcommand_it_follows(line, prog):
    """Review of issue 30: ``doctor --bogus`` said "flashinfer-safe-workspace: error:" without
    the subcommand, unlike every other refusal of a subcommand's arguments."""
    proc = cli(line)
    assert proc.returncode == REFUSED and proc.stdout == "", proc.stderr
    name = f"python -m flashinfer_safe_workspace{' ' + prog if prog else ''}"
    assert proc.stderr.splitlines() == [
        f"{name}: error: unrecognized arguments: {line.split()[-1] if prog else '--bogus'} "
        f"(see: {name} --help)"], proc.stderr


def test_ctrl_c_exits_130_as_documented(monkeypatch):
    """Review of issue 30: Ctrl-C exits 130, and docs/cli.md's exit-code table did not say
    so (test_docs_cli_covers_… reads a row per EXIT_CODES entry)."""
    import importlib
    from pathlib import Path

    _main = importlib.import_module("flashinfer_safe_workspace.cli.main")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_main, "_dispatch", interrupted)
    code = _main.main(["plan", "--flashinfer-version", "0.7.4"])
    assert code == 130 and code in _main.EXIT_CODES
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert re.search(r"^\| 130 \| .*Ctrl-C", doc, re.M)


def test_an_unknown_command_lists_only_the_public_ones():
    """Issue 23, C4: the message listed the internal _demo-rank."""
    proc = cli("frobnicate")
    assert "_demo-rank" not in proc.stderr
    assert all(name in proc.stderr for name in ("demo", "plan", "check", "doctor"))


def test_help_says_each_default_once():
    """Issue 23, C4: seven options printed "(default: ...) (default: None)"."""
    for command in ("plan", "check", "demo", "doctor"):
        text = " ".join(cli(f"{command} --help").stdout.split())
        assert "(default: None)" not in text, command
        assert text.count("(default:") == len(re.findall(r"\(default: [^)]*\)", text))
    plan = " ".join(cli("plan --help").stdout.split())
    assert "(default: the installed FlashInfer)" in plan and "(default: from --facts)" in plan
    assert "this rank (below --world-size) (default: 0)" in plan  # a 0 is a default too
    assert "CUDA ordinal asked for the driver's facts (default: 0)" in plan


def test_the_console_script_names_itself():
    """Issue 23: the installed command's messages said "python -m ...". The console script
    the package installs, run as it is installed, names itself."""
    import shutil

    script = shutil.which("flashinfer-safe-workspace", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the console script is not installed next to this interpreter")
    run = lambda *a: subprocess.run([script, *a], env=clean_env(), capture_output=True,  # noqa
                                    text=True, timeout=120)
    bad = run("plan", "--rank", "5")
    assert bad.returncode == REFUSED
    assert bad.stderr.startswith("flashinfer-safe-workspace plan: error: --rank 5"), bad.stderr
    assert "python -m" not in bad.stderr
    assert run("--help").stdout.startswith("usage: flashinfer-safe-workspace ")
    module = cli("plan --rank 5")
    assert module.stderr.startswith("python -m flashinfer_safe_workspace plan: error:")


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


def test_docs_cli_covers_the_console_script_every_command_and_exit_code():
    """docs/cli.md is the reference: the console script pyproject installs, a section per
    subcommand the parser has, and a row per exit code the commands use."""
    import importlib
    from pathlib import Path

    _main = importlib.import_module("flashinfer_safe_workspace.cli.main")  # the module

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "cli.md").read_text()
    script = re.search(r'^(\S+) = "flashinfer_safe_workspace\.cli:main"',
                       (root / "pyproject.toml").read_text(), re.M).group(1)
    assert script == "flashinfer-safe-workspace" and f"    {script} " in doc
    assert sorted(_main.COMMANDS) == ["check", "demo", "doctor", "plan"]
    usage = cli("--help").stdout
    for name in _main.COMMANDS:
        assert f"    {name} " in usage, name  # each is a real subcommand
        assert re.search(rf"^## `{name}`", doc, re.M), name
        assert f"{script} {name}" in doc, name
    for code in _main.EXIT_CODES:
        assert re.search(rf"^\| {code} \|", doc, re.M), code


# --------------------------------------------------------------------------- issue 30's edges


def cli_argv(*argv: str, **env):
    """``cli`` with the arguments as given (no splitting) and extra environment."""
    return subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", *argv],
                          env=clean_env(**env), capture_output=True, text=True, timeout=120)


SPELLINGS = [  # (spelling, verified) for those the library reads; None: not a version
    ("0.7.2-1", True),  # PEP 440's implicit post release: 0.7.2.post1
    ("0.7.2.post1", True), ("v0.7.4", True), ("0.7.4.0", True),
    ("0.7.4+cu129", False),  # a local build
    ("0.7.4rc1", False), ("0.7.4.dev0", False), ("0.7.5", False), ("1.2.3.4.5", False),
    ("0.7.4postpost", None), ("0.7.4 post1", None), ("0.7.4+", None), ("seven", None),
]


@pytest.mark.parametrize("spelling,verified", SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_version_spellings_follow_the_library_s_parser(spelling, verified):
    """Issue 30: ``0.7.4+cu129`` and ``0.7.2-1`` were refused with exit 2 (the CLI had a
    pattern of its own); the library reads both. What the library's parser reads is
    planned (verified only for a release whose source was read); anything else is refused
    in one line, not described as a build."""
    from flashinfer_safe_workspace.planning.rules import versions

    proc = cli_argv("plan", "--flashinfer-version", spelling, "--json")
    assert "Traceback" not in proc.stderr
    if verified is None:
        assert proc.returncode == REFUSED and proc.stdout == "", proc.stderr
        assert "argument --flashinfer-version: expected a FlashInfer release in PEP 440" \
            in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "build" not in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["verified"] is verified
        assert ("warning: FlashInfer" in proc.stderr) is (not verified), proc.stderr
    if spelling == "0.7.2-1":  # the very plan of 0.7.2.post1
        same = json.loads(cli_argv("plan", "--flashinfer-version", "0.7.2.post1",
                                   "--json").stdout)
        assert doc["rules"] == same["rules"] == "R9"
        assert doc["allocations"] == same["allocations"]
    assert versions.is_version(spelling) is (verified is not None)  # the parser's own answer


@pytest.mark.parametrize("spelling", ["1", "v2", "1!0.7.4", "0!0.7.2.post1"])
def test_pep_440_spellings_no_flashinfer_release_uses_are_refused_with_the_reason(spelling):
    """Review of issue 30: ``1`` and ``1!0.7.4`` are valid PEP 440, yet were refused as "expected
    a FlashInfer release in PEP 440 spelling". The library's parser (the one that reads the
    installed release) reads neither, so they stay refused, with the true reason, and
    docs/cli.md says why."""
    from pathlib import Path
    from flashinfer_safe_workspace.planning.rules import versions

    assert not versions.is_version(spelling)  # what the refusal rests on
    proc = cli_argv("plan", "--flashinfer-version", spelling)
    assert proc.returncode == REFUSED and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert (f"argument --flashinfer-version: expected a FlashInfer release as "
            f"major.minor[.micro]: {spelling!r} is PEP 440, but no FlashInfer release has a "
            "bare major or an epoch") in line, line
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert "`1` and `1!0.7.4`" in doc


def test_a_local_build_is_planned_as_unverified_as_docs_cli_says():
    proc = cli_argv("plan", "--flashinfer-version", "0.7.4+cu129")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("FlashInfer 0.7.4+cu129 (R10)")
    assert "not verified: FlashInfer 0.7.4+cu129 is a pre-release, development or local build" \
        in proc.stdout
    assert "0.7.4+cu129" in (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()


def test_text_that_is_no_version_is_not_called_a_build():
    """Issue 30: ``0.7.4postpost`` was planned and called "a pre-release, development or
    local build". The command line refuses it; a runtime version that only the loose
    prefix reads is said to be no PEP 440 version."""
    from flashinfer_safe_workspace.planning.rules import versions

    proc = cli_argv("plan", "--flashinfer-version", "0.7.4postpost")
    assert proc.returncode == REFUSED and "pre-release" not in proc.stderr, proc.stderr
    assert versions.unverified_why("0.7.4postpost") == (
        "not a PEP 440 version (read as 0.7.4), not a release whose source was read")
    assert versions.unverified_why("0.7.4+cu129").startswith("a pre-release, development")


NON_ASCII = [  # each holds a digit that int() or float() reads, but not 0-9
    ("plan", "--world-size", "\U0001d7e0"),  # MATHEMATICAL DOUBLE-STRUCK DIGIT EIGHT
    ("plan", "--max-token-num", "\u0662\u0660\u0664\u0668"),  # Arabic-Indic 2048
    ("plan", "--hidden-dim", "\uff14\uff10\uff19\uff16"),  # fullwidth 4096
    ("plan", "--granularity", "\u0664\u0660\u0669\u0666"),
    ("plan", "--flashinfer-version", "\u0660.\u0667.\u0664"),  # Arabic-Indic 0.7.4
    ("plan", "--flashinfer-version", "0.7.\u0664"),
    ("plan", "--world-size", "1_0"),  # int() reads 10
    ("check", "--default-shape", "--headroom-mb", "\u0668"),
    ("check", "--default-shape", "--device", "\u0966"),  # Devanagari 0
    ("demo", "--vote-timeout", "\u0661\u0660"),  # float() reads 10.0
    ("demo", "--starve-rank", "\u0661"),
]


@pytest.mark.parametrize("argv", NON_ASCII, ids=[a[1] + "=" + ascii(a[-1]) for a in NON_ASCII])
def test_only_ascii_digits_are_read(argv):
    """Issue 30: ``--world-size 𝟠`` planned 8 ranks and ``--flashinfer-version ٠.٧.٤``
    a verified 0.7.4."""
    proc = cli_argv(*argv)
    assert proc.returncode == REFUSED and proc.stdout == "", (proc.stdout, proc.stderr)
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and f"argument {argv[-2]}: expected" in line, line
    assert "0-9" in line


def test_the_library_reads_no_digit_outside_ascii_either():
    from flashinfer_safe_workspace.planning.plan import Unplanned
    from flashinfer_safe_workspace.planning.rules import versions

    for text in ("\u0660.\u0667.\u0664", "0.\U0001d7df.4", "0.7.2.post\u0661"):
        assert versions.canonical(text) is None, text  # was "0.7.4": a verified release
    with pytest.raises(Unplanned):
        versions.parse_version("\u0660.\u0667.\u0664")
    assert versions.parse_version("0.7.2.post\u0661") == (0, 7, 2, 0)  # the prefix only
    assert not any(map(versions.is_version, ("\u0660.\u0667.\u0664", "0.7.2.post\u0661")))


@pytest.mark.parametrize("argv,env", [
    (("_demo-rank",), {}),
    (("_demo-rank", "--help"), {}),
    (("_demo-rank", "--rank", "0"), {"MASTER_ADDR": "127.0.0.1"}),
    (("_demo-rank", "--help"), {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
    (("_demo-rank", "--world-size", "\U0001d7e0"),
     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
], ids=["bare", "help", "no-port", "help-in-demo-env", "non-ascii-in-demo-env"])
def test_the_hidden_rank_command_fails_in_one_line(argv, env):
    """Issue 30: ``_demo-rank --help`` printed 35 lines and a bare ``_demo-rank`` said
    "internal error: KeyError: 'MASTER_ADDR' (please report it)". Run without what demo
    gives it, it is refused in one line pointing at demo; it stays out of the help."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.setdefault(name, "")
    proc = cli_argv(*argv, **env)
    assert proc.returncode == REFUSED and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "_demo-rank: error: " in lines[0], proc.stderr
    assert "internal error" not in lines[0] and "Error" not in lines[0]
    assert lines[0].endswith("demo --help)")
    assert "_demo-rank" not in cli("--help").stdout


@pytest.mark.parametrize("parent", [None, "1", "not a pid"])
def test_a_hand_run_rank_with_a_torchrun_rendezvous_is_refused_at_once(parent):
    """Review of issue 30, M7: with MASTER_ADDR and MASTER_PORT set, as in any torchrun job,
    a hand-run ``_demo-rank`` joined the gloo rendezvous and waited there. It runs only
    when demo started it (demo's pid in DEMO_PARENT, which demo alone sets); otherwise it
    is refused in one line with exit 2 (bounded: a wait in the rendezvous fails the test)."""
    from flashinfer_safe_workspace import _config

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    if parent is not None:  # exported by hand: not this process's parent
        env[_config.DEMO_PARENT] = parent
    proc = subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "_demo-rank",
                           "--rank", "0", "--world-size", "2", "--mode", "simulated"],
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == REFUSED and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "_demo-rank: error: an internal command of demo" in lines[0]
    assert lines[0].endswith("demo --help)"), lines[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_says_the_shape_it_used_and_which_values_were_defaults():
    """Issue 30: ``plan`` without a shape planned T = 2048, H = 4096 and never said so."""
    bare = cli_argv("plan", "--flashinfer-version", "0.7.4")
    assert bare.returncode == 0, bare.stderr
    lines = bare.stdout.splitlines()
    assert lines[1] == ("  shape: world size ws=2, rank 0, max_token_num T=2048, hidden_dim "
                        "H=4096, dtype bfloat16 (defaults, not given: --world-size, --rank, "
                        "--max-token-num, --hidden-dim, --dtype)"), bare.stdout
    given = cli_argv("plan", "--flashinfer-version", "0.7.4", "--max-token-num", "128",
                     "--world-size", "4")
    shape = next(line for line in given.stdout.splitlines() if line.startswith("  shape:"))
    assert "ws=4" in shape and "T=128" in shape and "H=4096" in shape
    assert shape.endswith("(defaults, not given: --rank, --hidden-dim, --dtype)"), shape
    everything = ("--world-size", "2", "--rank", "0", "--max-token-num", "2048",
                  "--hidden-dim", "4096", "--dtype", "bfloat16")
    full = cli_argv("plan", "--flashinfer-version", "0.7.4", *everything)
    assert "defaults" not in full.stdout
    # the shape said is the shape planned: the defaults plan what the explicit values plan
    doc = json.loads(cli_argv("plan", "--flashinfer-version", "0.7.4", "--json").stdout)
    explicit = json.loads(cli_argv("plan", "--flashinfer-version", "0.7.4", "--json",
                                   *everything).stdout)
    assert doc["shape"] == explicit["shape"] == {"world_size": 2, "rank": 0,
                                                 "max_token_num": 2048, "hidden_dim": 4096,
                                                 "dtype": "bfloat16"}
    assert doc["defaults"] == ["--world-size", "--rank", "--max-token-num", "--hidden-dim",
                               "--dtype"] and explicit["defaults"] == []
    assert doc["allocations"] == explicit["allocations"]
    rejected = cli_argv("plan", "--flashinfer-version", "0.5.0", "--hidden-dim", "512")
    assert rejected.returncode == REFUSED and "  shape: " in rejected.stdout
    assert "H=512" in rejected.stdout
