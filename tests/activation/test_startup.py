"""Start-up behaviour in fresh interpreters, with the package installed (the `.pth`)."""

from __future__ import annotations

import json
import site
import sys
from pathlib import Path

import pytest

from harness import run_python

HEAVY = ("wrapt", "torch", "flashinfer", "flashinfer_safe_workspace")
LOADED = ("import sys, json; print('OUT' + json.dumps([m for m in %r if m in sys.modules]))" % (HEAVY,))


def _pth_installed() -> bool:
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    return any((Path(d) / "flashinfer_safe_workspace.pth").exists() for d in dirs)


pytestmark = pytest.mark.skipif(not _pth_installed(),
                                reason="the package is not installed (no .pth in site-packages)")


def _loaded(env, args=()):
    proc = run_python(LOADED, env=env, args=args)
    assert proc.returncode == 0, proc.stderr
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:]), proc


def test_unset_imports_nothing_of_ours():
    loaded, proc = _loaded({})
    assert loaded == []
    assert proc.stderr == ""


@pytest.mark.parametrize("value", ["", "0", "off", "FALSE", "no"])
def test_off_loads_only_the_gate(value):
    """A variable that is present but off: the .pth line hands it to the gate (the spellings'
    one home), which stops there: no bootstrap, no settings, nothing heavy."""
    code = ("import sys, json; print('OUT' + json.dumps(sorted(m for m in sys.modules"
            " if m.startswith(('flashinfer', 'wrapt', 'torch')))))")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": value})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    loaded = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    assert loaded == sorted(["flashinfer_safe_workspace", "flashinfer_safe_workspace._errors",
                             "flashinfer_safe_workspace._switch",
                             "flashinfer_safe_workspace._version",
                             "flashinfer_safe_workspace.activation",
                             "flashinfer_safe_workspace.activation.gate"])


def test_on_without_flashinfer_loads_neither_wrapt_nor_torch():
    loaded, proc = _loaded({"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert loaded == ["flashinfer_safe_workspace"]


def test_malformed_value_warns_once_and_stays_off():
    loaded, proc = _loaded({"FLASHINFER_SAFE_WORKSPACE": "maybe"})
    assert "wrapt" not in loaded and "flashinfer" not in loaded
    assert proc.stderr.count("FLASHINFER_SAFE_WORKSPACE") == 1  # one warning, even with .pth run twice


def test_on_wraps_after_import_flashinfer_comm_without_importing_us():
    """The variable alone (the .pth) wraps both functions with OUR proxy, which still
    reaches FlashInfer's own function."""
    code = ("import flashinfer.comm as c, json, inspect\n"
            "from flashinfer_safe_workspace.activation import patch as _patch\n"
            "u, l = c.create_allreduce_fusion_workspace, c.trtllm_create_ipc_workspace_for_all_reduce_fusion\n"
            "print('OUT' + json.dumps([_patch.is_ours(u), _patch.is_ours(l),"
            " u.__wrapped__.__module__, u.__wrapped__.__name__,"
            " _patch.is_ours(u.__wrapped__), 'backend' in inspect.signature(u).parameters]))")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    assert out == [True, True, "flashinfer.comm.allreduce", "create_allreduce_fusion_workspace",
                   False, True]


def test_off_leaves_flashinfer_unwrapped():
    code = ("import flashinfer.comm as c, sys\n"
            "from flashinfer.comm import allreduce\n"
            "print('OUT', hasattr(c.create_allreduce_fusion_workspace, '__wrapped__'),"
            " c.create_allreduce_fusion_workspace is allreduce.create_allreduce_fusion_workspace,"
            " 'flashinfer_safe_workspace.activation.bootstrap' in sys.modules)")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "0"})
    assert "OUT False True False" in proc.stdout, proc.stdout + proc.stderr


def test_no_site_flag_disables_the_pth():
    loaded, _ = _loaded({"FLASHINFER_SAFE_WORKSPACE": "1"}, args=("-S",))
    assert loaded == []


def test_child_processes_inherit_activation():
    code = ("import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-c', 'import flashinfer.comm as c; "
            "from flashinfer_safe_workspace.activation import patch as _patch; "
            "print(_patch.is_ours(c.create_allreduce_fusion_workspace))'],"
            " capture_output=True, text=True, timeout=240)\n"
            "print('OUT', r.stdout.strip())")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "1"}, timeout=300)
    assert "OUT True" in proc.stdout, proc.stderr
