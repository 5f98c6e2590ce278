"""Compatibility matrix: wrapt 1.17 and 2.x (C extension and pure Python), cuda-python
12.x (``cuda.cuda``) and 13.x (``cuda.bindings.driver``).

Other versions are installed at test time with ``pip install --no-deps --target``
into a cache outside the repository (``$FIWS_COMPAT_CACHE`` or
``~/.cache/fiws-compat``) and put first on ``PYTHONPATH`` of a fresh interpreter;
a failed download skips with the reason. Every subprocess is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

import flashinfer_safe_workspace

TIMEOUT = 180
PKG = Path(flashinfer_safe_workspace.__file__).resolve().parent


def package_only_dir() -> Path:
    """A directory holding only this package (a symlink): on ``PYTHONPATH`` under ``-S`` it
    brings the package without the rest of its site-packages (cuda-python 13 among it).
    One directory per installed copy (named by its path's digest), and the link made under
    a temporary name and renamed into place: suites running side by side (and the suite's
    own workers) never re-point each other's link."""
    root = _cache() / "package-only" / hashlib.sha256(str(PKG).encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    link = root / PKG.name
    if not (link.is_symlink() and link.resolve() == PKG):
        tmp = root / f".{PKG.name}.{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(PKG, target_is_directory=True)
        os.replace(tmp, link)
    return root


def _cache() -> Path:
    root = os.environ.get("FIWS_COMPAT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "fiws-compat"


def pip_target(spec: str) -> Path:
    """A directory holding ``spec`` (``name==version``) installed with --no-deps."""
    final = _cache() / spec.replace("==", "-")
    if (final / ".fiws-complete").exists():
        return final
    # installed beside, then renamed into place: suites side by side never share a half-made one
    target = final.with_name(f"{final.name}.{os.getpid()}")
    shutil.rmtree(target, ignore_errors=True)
    marker = target / ".fiws-complete"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
           "--upgrade", "--target", str(target), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install {spec} timed out")
    if proc.returncode != 0:
        pytest.skip(f"pip install {spec} failed: {(proc.stderr or proc.stdout)[-300:]}")
    marker.write_text(spec)
    try:
        os.rename(target, final)
    except OSError:  # another suite put its copy in place first: use that one
        shutil.rmtree(target, ignore_errors=True)
    return final


def _env(pythonpath=(), **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLASHINFER_SAFE_WORKSPACE") and k != "WRAPT_DISABLE_EXTENSIONS"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *(
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    env.update(extra)
    return env


def run_json(code: str, env, *flags):
    proc = subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- wrapt

WRAPT_CHECK = """
    import inspect, json, sys
    import wrapt
    import torch
    import flashinfer.comm as comm                      # the .pth activated the shim
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace.activation import patch as _patch; from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    names = ("create_allreduce_fusion_workspace",
             "trtllm_create_ipc_workspace_for_all_reduce_fusion")
    out = {"wrapt": wrapt.__version__, "wrapt_file": wrapt.__file__,
           "wrapped": _patch.wrapped_bindings()}
    for name in names:
        proxy = getattr(comm, name)
        orig = proxy.__wrapped__
        out[name] = {
            "ours": _patch.is_ours(proxy),
            "function_wrapper": isinstance(proxy, wrapt.FunctionWrapper),
            "same_signature": inspect.signature(proxy) == inspect.signature(orig),
            "signature": str(inspect.signature(proxy)),
            "name": proxy.__name__ == orig.__name__ == name,
            "doc": proxy.__doc__ == orig.__doc__,
            "module": proxy.__module__ == orig.__module__,
            "single_layer": not _patch.is_ours(orig),
        }
    _probe.set_prober(SimulatedDevice(64 << 20))  # too small: a local veto
    out["veto_none"] = repr(comm.create_allreduce_fusion_workspace(
        backend="trtllm", world_size=1, rank=0, max_token_num=256, hidden_dim=1024,
        dtype=torch.bfloat16))
    try:
        comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(0, 1, 256, 1024)
        out["legacy"] = "returned"
    except fiws.WorkspaceVetoed as exc:
        out["legacy"] = "WorkspaceVetoed"
    from flashinfer.comm import allreduce
    fiws.uninstall()
    out["restored"] = not any(_patch.is_ours(getattr(m, n, None))
                              for m in (comm, allreduce) for n in names)
    print(json.dumps(out))
"""


def _wrapt_dirs(which):
    if which == "installed":
        return []
    return [pip_target(f"wrapt=={which}")]


@pytest.mark.parametrize("pure", [False, True], ids=["c-ext", "pure-python"])
@pytest.mark.parametrize("which", ["1.17.3", "installed"])
def test_wrapt_versions_wrap_and_preserve_signature(which, pure):
    dirs = _wrapt_dirs(which)
    extra = {"FLASHINFER_SAFE_WORKSPACE": "1"}
    if pure:
        extra["WRAPT_DISABLE_EXTENSIONS"] = "true"
    out = run_json(WRAPT_CHECK, _env(dirs, **extra))
    expected = "1.17.3" if which == "1.17.3" else version("wrapt")
    assert out["wrapt"] == expected
    if dirs:
        assert out["wrapt_file"].startswith(str(dirs[0]))
    for name in ("create_allreduce_fusion_workspace",
                 "trtllm_create_ipc_workspace_for_all_reduce_fusion"):
        facts = out[name]
        assert facts == {**facts, "ours": True, "function_wrapper": True, "same_signature": True,
                         "name": True, "doc": True, "module": True, "single_layer": True}
        assert f"flashinfer.comm.{name}" in out["wrapped"]
        assert f"flashinfer.comm.allreduce.{name}" in out["wrapped"] or name.startswith("trtllm")
    assert "backend" in out["create_allreduce_fusion_workspace"]["signature"]
    assert out["veto_none"] == "None"
    assert out["legacy"] == "WorkspaceVetoed"


def test_uninstall_after_hook_install_restores_every_binding():
    out = run_json(WRAPT_CHECK, _env([], FLASHINFER_SAFE_WORKSPACE="1"))
    assert out["restored"] is True


def test_wrapt_1_is_not_loaded_before_flashinfer():
    """With wrapt 1.17 too, a shim that is on but whose target is never imported stays
    cheap: the lazy bootstrap keeps wrapt out until FlashInfer is imported."""
    dirs = _wrapt_dirs("1.17.3")
    out = run_json("""
        import json, sys
        import flashinfer_safe_workspace as f
        print(json.dumps({"wrapt": "wrapt" in sys.modules, "flashinfer": "flashinfer" in sys.modules}))
    """, _env(dirs, FLASHINFER_SAFE_WORKSPACE="1"))
    assert out["flashinfer"] is False
    assert out["wrapt"] is False


# --------------------------------------------------------------------------- cuda-python

CUDA_CHECK = """
    import json
    from flashinfer_safe_workspace.planning import probe as _probe
    drv = _probe.driver_module()
    out = {"module": drv.__name__}
    try:
        _probe.CudaProber().driver()
        out["probe"] = "ready"
    except _probe.ProbeUnavailable as exc:
        out["probe"] = "ProbeUnavailable"
        out["why"] = str(exc)
    try:
        from cuda.bindings import driver
        out["has_bindings"] = True
    except ImportError:
        out["has_bindings"] = False
    print(json.dumps(out))
"""


def _no_driver_here():
    from flashinfer_safe_workspace.planning import probe as _probe

    try:
        _probe.CudaProber().driver()
    except _probe.ProbeUnavailable:
        return
    pytest.skip("this machine has a CUDA driver; the no-driver path cannot be shown")


def test_cuda_python_13_uses_cuda_bindings_driver():
    out = run_json(CUDA_CHECK, _env())
    assert out["module"] == "cuda.bindings.driver" and out["has_bindings"] is True
    _no_driver_here()
    assert out["probe"] == "ProbeUnavailable"


def _cuda12_env():
    # -S keeps site-packages (and its cuda-python 13) off sys.path: only the 12.x
    # install and this package's source tree are importable, plus the stdlib.
    target = pip_target("cuda-python==12.4.0")
    return _env([target, package_only_dir()])


def test_cuda_python_12_uses_cuda_cuda_and_fails_cleanly_without_driver():
    out = run_json(CUDA_CHECK, _cuda12_env(), "-S")
    assert out["has_bindings"] is False  # 12.4 predates cuda.bindings
    assert out["module"] == "cuda.cuda"
    _no_driver_here()
    assert out["probe"] == "ProbeUnavailable"
    assert "libcuda" in out["why"] or "driver" in out["why"].lower()


def test_cuda_python_12_check_and_doctor_say_no_driver():
    env = _cuda12_env()
    _no_driver_here()
    check = subprocess.run([sys.executable, "-S", "-m", "flashinfer_safe_workspace", "check",
                            "--flashinfer-version", "0.7.4", "--default-shape"], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert check.returncode == 2, check.stdout + check.stderr
    assert "cannot-tell" in check.stdout
    doctor = subprocess.run([sys.executable, "-S", "-m", "flashinfer_safe_workspace", "doctor",
                             "--json", "--no-import"], env=env, capture_output=True, text=True,
                            timeout=TIMEOUT)
    report = json.loads(doctor.stdout)
    assert report["cuda"]["bindings"] == "cuda.cuda"
    assert report["cuda"]["error"].startswith("no driver")
    assert report["pth"]["site_enabled"] is False  # -S: no .pth runs
