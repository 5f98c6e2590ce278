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


@pytest.mark.parametrize("value", [None, "", "0", "off", "FALSE", "no"])
def test_off_imports_nothing_of_ours(value):
    env = {} if value is None else {"FLASHINFER_SAFE_WORKSPACE": value}
    loaded, proc = _loaded(env)
    assert loaded == []
    assert proc.stderr == ""


def test_on_without_flashinfer_loads_neither_wrapt_nor_torch():
    loaded, proc = _loaded({"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert loaded == ["flashinfer_safe_workspace"]


def test_malformed_value_warns_once_and_stays_off():
    loaded, proc = _loaded({"FLASHINFER_SAFE_WORKSPACE": "maybe"})
    assert "wrapt" not in loaded and "flashinfer" not in loaded
    assert proc.stderr.count("FLASHINFER_SAFE_WORKSPACE") == 1  # one warning, even with .pth run twice


def test_on_wraps_after_import_flashinfer_comm_without_importing_us():
    code = ("import flashinfer.comm as c, json\n"
            "print('OUT' + json.dumps([hasattr(c.create_allreduce_fusion_workspace, '__wrapped__'),"
            " hasattr(c.trtllm_create_ipc_workspace_for_all_reduce_fusion, '__wrapped__'),"
            " c.create_allreduce_fusion_workspace.__wrapped__.__wrapped__ is None"
            " if hasattr(c.create_allreduce_fusion_workspace.__wrapped__, '__wrapped__') else True]))")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])
    assert out[0] and out[1]


def test_off_leaves_flashinfer_unwrapped():
    code = ("import flashinfer.comm as c\n"
            "print('OUT', hasattr(c.create_allreduce_fusion_workspace, '__wrapped__'))")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "0"})
    assert "OUT False" in proc.stdout


def test_no_site_flag_disables_the_pth():
    loaded, _ = _loaded({"FLASHINFER_SAFE_WORKSPACE": "1"}, args=("-S",))
    assert loaded == []


def test_child_processes_inherit_activation():
    code = ("import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-c', 'import flashinfer.comm as c; "
            "print(hasattr(c.create_allreduce_fusion_workspace, \"__wrapped__\"))'],"
            " capture_output=True, text=True, timeout=60)\n"
            "print('OUT', r.stdout.strip())")
    proc = run_python(code, env={"FLASHINFER_SAFE_WORKSPACE": "1"}, timeout=90)
    assert "OUT True" in proc.stdout, proc.stderr
