"""Hooks against the real installed flashinfer, in fresh interpreters."""

from __future__ import annotations

import json

from harness import run_python

CHECK = """
import inspect, json, sys
import flashinfer.comm as comm, flashinfer.comm.allreduce as ar, flashinfer.comm.trtllm_ar as tr
from flashinfer_safe_workspace.activation import patch as _patch
def ours(f): return _patch.is_ours(f)
def depth(f):
    n = 0
    while _patch.is_ours(f):
        n += 1; f = f.__wrapped__
    return n
names = ["create_allreduce_fusion_workspace", "trtllm_create_ipc_workspace_for_all_reduce_fusion"]
out = {
  "comm.unified": ours(comm.create_allreduce_fusion_workspace),
  "allreduce.unified": ours(ar.create_allreduce_fusion_workspace),
  "comm.legacy": ours(comm.trtllm_create_ipc_workspace_for_all_reduce_fusion),
  "allreduce.legacy": ours(ar.trtllm_create_ipc_workspace_for_all_reduce_fusion),
  "trtllm_ar.legacy": ours(tr.trtllm_create_ipc_workspace_for_all_reduce_fusion),
  "depth": max(depth(getattr(m, n)) for m in (comm, ar, tr) for n in names if hasattr(m, n)),
}
"""


def _run(code, env=None):
    proc = run_python(code + "\nprint('OUT' + json.dumps(out))", env=env)
    assert proc.returncode == 0, proc.stderr
    line = [l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1]
    return json.loads(line[3:])


ALL = {"comm.unified": True, "allreduce.unified": True, "comm.legacy": True,
       "allreduce.legacy": True, "trtllm_ar.legacy": True, "depth": 1}


def test_install_before_flashinfer_import_wraps_every_namespace():
    out = _run("import flashinfer_safe_workspace as f; f.install()\n" + CHECK)
    assert out == ALL


def test_install_after_flashinfer_import_wraps_every_namespace():
    out = _run("import flashinfer.comm\nimport flashinfer_safe_workspace as f; f.install()\n" + CHECK)
    assert out == ALL


def test_double_install_never_double_wraps():
    out = _run("import flashinfer_safe_workspace as f; f.install(); f.install()\n" + CHECK
               + "\nf.install(); import importlib; out['depth2'] = depth(comm.create_allreduce_fusion_workspace)")
    assert out["depth"] == 1 and out["depth2"] == 1


def test_env_var_gate_activates_and_off_does_not():
    """The variable (installed .pth) wraps everything; off, nothing is wrapped."""
    on = _run("import flashinfer_safe_workspace\n" + CHECK, env={"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert on == ALL
    off = _run("import flashinfer_safe_workspace\n" + CHECK, env={"FLASHINFER_SAFE_WORKSPACE": "0"})
    assert not any(v for k, v in off.items() if k != "depth") and off["depth"] == 0


def test_uninstall_restores_the_originals_by_identity():
    out = _run("""
import flashinfer.comm.allreduce as ar0
orig = ar0.create_allreduce_fusion_workspace
orig_legacy = ar0.trtllm_create_ipc_workspace_for_all_reduce_fusion
import flashinfer_safe_workspace as f
f.install(); f.uninstall()
""" + CHECK + """
out["same"] = comm.create_allreduce_fusion_workspace is orig and ar.trtllm_create_ipc_workspace_for_all_reduce_fusion is orig_legacy
out["installed"] = f.is_installed()
f.install()
out["again"] = ours(comm.create_allreduce_fusion_workspace)
""")
    assert out["same"] and not out["installed"] and out["again"]
    assert out["depth"] == 0


def test_uninstall_leaves_a_foreign_wrapper_on_top_alone():
    out = _run("""
import functools, flashinfer.comm as c
import flashinfer_safe_workspace as f
f.install()
ours_proxy = c.create_allreduce_fusion_workspace
@functools.wraps(ours_proxy)
def foreign(*a, **k): return ours_proxy(*a, **k)
c.create_allreduce_fusion_workspace = foreign
f.uninstall()
""" + CHECK + """
out["foreign_kept"] = comm.create_allreduce_fusion_workspace is foreign
""")
    assert out["foreign_kept"]
    assert out["allreduce.unified"] is False  # the other bindings were restored


def test_wrapper_preserves_signature_name_doc_wrapped():
    out = _run("""
import inspect, flashinfer.comm.allreduce as a
orig = a.create_allreduce_fusion_workspace
sig, doc = inspect.signature(orig), orig.__doc__
import flashinfer_safe_workspace as f; f.install()
""" + CHECK + """
w = comm.create_allreduce_fusion_workspace
out["sig"] = inspect.signature(w) == sig
out["name"] = w.__name__ == "create_allreduce_fusion_workspace"
out["doc"] = w.__doc__ == doc
out["wrapped"] = w.__wrapped__ is orig
out["params"] = "comm_backend" in inspect.signature(w).parameters and "group" in inspect.signature(w).parameters
""")
    assert out["sig"] and out["name"] and out["doc"] and out["wrapped"] and out["params"]


def test_arguments_flashinfer_rejects_pass_through_with_its_own_error():
    out = _run("""
import json
import flashinfer_safe_workspace as f; f.install(on_veto="raise")
import flashinfer.comm as comm
out = {}
try:
    comm.create_allreduce_fusion_workspace(backend="nccl-magic", world_size=1, rank=0,
        max_token_num=16, hidden_dim=64, dtype=None)
except Exception as e:
    out["type"] = type(e).__name__; out["msg"] = str(e)
try:
    comm.create_allreduce_fusion_workspace(no_such_argument=1)
except Exception as e:
    out["type2"] = type(e).__name__
""")
    assert out["type"] == "RuntimeError" and "Unknown backend" in out["msg"]
    assert out["type2"] == "TypeError"
