"""Activation, every path through one gate, each in a fresh interpreter: the ``.pth`` line,
the ``.start`` file (PEP 829), plain import (activates nothing), ``install()``; the order
they run in and running twice. The engines' real plugin loaders are in
``tests/engines/test_plugins.py``; the built wheel's contents in ``tests/package/test_wheel.py``.

The interpreters run with ``-S`` (no site-packages ``.pth`` runs by itself) and the
installed package's folder on ``PYTHONPATH``, so the path under test is the only one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import harness

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "flashinfer_safe_workspace.pth"
START = ROOT / "flashinfer_safe_workspace.start"

REPORT = """
import json, sys
_ours = sorted(m for m in sys.modules if m.startswith("flashinfer_safe_workspace"))
_heavy = [m for m in ("wrapt", "torch", "flashinfer") if m in sys.modules]
from flashinfer_safe_workspace.activation import bootstrap as _b
print("OUT" + json.dumps({"by": _b.activated_by(), "watching": _b.watching(),
    "hooks": _b.hooks_registered, "ours": _ours, "heavy": _heavy}))
"""


def package_dirs() -> list:
    """Where the installed package and its dependencies are found, for ``-S`` children."""
    import flashinfer_safe_workspace
    import wrapt

    return [str(Path(flashinfer_safe_workspace.__file__).resolve().parents[1]),
            str(Path(wrapt.__file__).resolve().parents[1])]


def run_bare(code: str, value, *, extra_path=(), timeout=300.0) -> dict:
    """``code`` then REPORT in ``python -S`` with the variable set to ``value`` (None:
    unset); returns the report, with the child's stderr under ``stderr``."""
    env = harness.clean_env()
    if value is not None:
        env["FLASHINFER_SAFE_WORKSPACE"] = value
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, *package_dirs(), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-S", "-c", code + REPORT], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    out["stderr"] = proc.stderr
    return out


GATE_ONLY = ["flashinfer_safe_workspace", "flashinfer_safe_workspace._errors",
             "flashinfer_safe_workspace._switch",
             "flashinfer_safe_workspace._version", "flashinfer_safe_workspace.activation",
             "flashinfer_safe_workspace.activation.gate"]


# ------------------------------------------------------------------ import activates nothing
def test_importing_the_package_activates_nothing():
    """The CLI and install() import the package: with the variable on, import alone (and
    the command line's modules) must leave nothing active."""
    out = run_bare("import flashinfer_safe_workspace, flashinfer_safe_workspace.cli.main", "1")
    assert out["by"] is None and not out["watching"] and not out["hooks"]


# ------------------------------------------------------------------ the .pth line
def pth_line() -> str:
    lines = [l for l in PTH.read_text().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("import "), lines  # site.py runs such a line
    return lines[0]


def test_pth_line_with_the_variable_unset_imports_nothing_of_ours():
    out = run_bare(f"exec({pth_line()!r})\nimport sys\nassert not any("
                   "m.startswith('flashinfer_safe_workspace') for m in sys.modules)", None)
    assert out["by"] is None


@pytest.mark.parametrize("value", ["0", "off", " NO ", ""])
def test_pth_line_switched_off_loads_only_the_gate(value):
    out = run_bare(f"exec({pth_line()!r})", value)
    assert out["ours"] == sorted(GATE_ONLY)  # no bootstrap, no _config
    assert out["by"] is None and not out["watching"]


@pytest.mark.parametrize("value", ["1", "true", " On "])
def test_pth_line_on_waits_for_flashinfer_cheaply(value):
    out = run_bare(f"exec({pth_line()!r})", value)
    assert out["by"] == "pth" and out["watching"] and not out["hooks"]
    assert out["heavy"] == []
    assert "flashinfer_safe_workspace._config" not in out["ours"]


def test_pth_line_with_a_bad_value_warns_once_and_stays_off():
    out = run_bare(f"exec({pth_line()!r})\nexec({pth_line()!r})", "maybe")
    assert out["by"] is None and not out["watching"] and not out["hooks"]
    assert out["stderr"].count("FLASHINFER_SAFE_WORKSPACE") == 1, out["stderr"]


# ------------------------------------------------------------------ the .start file (PEP 829)
ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # pkg.mod:callable, callable required


def start_entries() -> list:
    entries = [l.strip() for l in START.read_text(encoding="utf-8-sig").splitlines()
               if l.strip() and not l.lstrip().startswith("#")]
    assert entries and all(ENTRY.match(e) for e in entries), entries
    return entries


PEP829 = """
import pkgutil
for entry in {entries!r}:
    pkgutil.resolve_name(entry)()   # resolved and called with no arguments, as site.py does
"""


def test_start_file_shares_the_pth_base_name():
    """Python 3.15's site.py silently skips the ``import`` lines of ``NAME.pth`` when a
    ``NAME.start`` exists beside it (site docs, PEP 829): the two names must match, or 3.15
    to 3.17 would run both paths."""
    assert PTH.suffix == ".pth" and START.suffix == ".start" and PTH.stem == START.stem


@pytest.mark.parametrize("value,active", [("1", True), (None, False), ("0", False)])
def test_start_file_resolved_as_pep_829_does(value, active):
    """The documented resolution: each ``pkg.mod:callable`` line through
    ``pkgutil.resolve_name`` and called without arguments."""
    out = run_bare(PEP829.format(entries=start_entries()), value)
    assert out["by"] == ("start" if active else None)
    assert out["watching"] is active and out["heavy"] == []
    if not active:
        assert out["ours"] == sorted(GATE_ONLY)


def _python_with_start_files():
    """A Python 3.15+ (whose site.py runs ``.start`` files), if this machine has one."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    names = [shutil.which(f"python3.{m}") for m in range(15, 25)]
    names += sorted(str(p) for p in root.glob("3.1[5-9]*/bin/python3"))
    return next((n for n in names if n), None)


def test_start_file_through_a_real_python_3_15(tmp_path):
    """Where an interpreter with PEP 829 exists: a site directory holding the package, its
    ``.pth`` and its ``.start``; site.py must run the ``.start`` entry and skip the
    ``.pth`` line (the shim names ``start`` as its path)."""
    exe = _python_with_start_files()
    if exe is None:
        pytest.skip("no Python 3.15+ here (PEP 829's site.py); the resolution test stands in")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copytree(ROOT / "flashinfer_safe_workspace", site_dir / "flashinfer_safe_workspace")
    shutil.copy(PTH, site_dir)
    shutil.copy(START, site_dir)
    code = ("import site, sys; site.addsitedir(sys.argv[1])\n" + REPORT)
    env = {"FLASHINFER_SAFE_WORKSPACE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([exe, "-S", "-c", code, str(site_dir)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    assert out["by"] == "start" and out["watching"]


# ------------------------------------------------------------------ order, twice, install()
ORDERS = {
    "pth-then-plugin-then-start": ("pth", ["from_pth", "vllm_plugin", "from_start_file"]),
    "plugin-first": ("plugin:sglang", ["sglang_plugin", "from_pth", "aphrodite_plugin"]),
    "start-twice": ("start", ["from_start_file", "from_start_file", "vllm_plugin"]),
}


@pytest.mark.parametrize("name", list(ORDERS))
def test_whichever_path_runs_first_activates_once(name):
    first, calls = ORDERS[name]
    code = ("from flashinfer_safe_workspace.activation import gate\n"
            + "".join(f"gate.{c}()\n" for c in calls)
            + "import flashinfer.comm as comm, flashinfer_safe_workspace as f\n"
            "from flashinfer_safe_workspace.activation import patch as p\n"
            "f.install(); gate.vllm_plugin()\n"
            "fn = comm.create_allreduce_fusion_workspace; depth = 0\n"
            "while p.is_ours(fn):\n    depth += 1; fn = fn.__wrapped__\n"
            "assert depth == 1, depth\n"
            "assert len(p.wrapped_bindings()) == 5, p.wrapped_bindings()\n")
    out = run_bare(code, "1", timeout=120)
    assert out["by"] == first and out["hooks"]


def test_install_names_itself_and_uninstall_forgets():
    code = ("import flashinfer_safe_workspace as f\n"
            "from flashinfer_safe_workspace.activation import bootstrap as b\n"
            "f.install(); assert b.activated_by() == 'install()', b.activated_by()\n"
            "f.uninstall(); assert b.activated_by() is None\n"
            "from flashinfer_safe_workspace.activation import gate; gate.vllm_plugin()\n")
    out = run_bare(code, "1")
    # the plugin came after an uninstall in a process whose bootstrap never ran: it activates
    assert out["by"] == "plugin:vllm" and out["watching"]


def test_doctor_names_the_path():
    """doctor's report and text name the activating path (here the .pth, the default)."""
    proc = harness.run_python(
        "from flashinfer_safe_workspace.cli import doctor; import json\n"
        "r = doctor.doctor_report(import_flashinfer=False)\n"
        "print('OUT' + json.dumps({'by': r['activated_by'], 'text': doctor.format_doctor(r)}))",
        env={"FLASHINFER_SAFE_WORKSPACE": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    expected = "start" if sys.version_info >= (3, 15) else "pth"
    assert out["by"] == expected
    assert f"activated by {expected}" in out["text"]
