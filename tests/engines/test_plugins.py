"""The engines' own plugin loaders, from their released wheels, activate the shim through
its entry points, in fresh interpreters: vLLM's ``load_general_plugins()``
(``vllm.general_plugins``, filtered by ``VLLM_PLUGINS``), SGLang's ``load_plugins()``
(``sglang.srt.plugins``, SGLang 0.5.11 and later, filtered by ``SGLANG_PLUGINS``) and
aphrodite's ``load_general_plugins()`` (``aphrodite.general_plugins``, ``APHRODITE_PLUGINS``).

Only the loader's files are fetched (``_engines.ENGINES``); the engine's package is a
namespace package in the cache, so importing its loader pulls in nothing else. The child
runs with ``-S``: no ``.pth`` runs, so the plugin is the only path that can activate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _runner import engine_root

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "activation"))

import harness  # noqa: E402
from test_activation import REPORT, package_dirs  # noqa: E402

# engine -> (dist, version, loader module, loader function, filter variable, path name)
LOADERS = {
    "vllm": ("vllm", "0.33.0", "vllm.plugins", "load_general_plugins", "VLLM_PLUGINS",
             "plugin:vllm"),
    "sglang": ("sglang", "0.5.23", "sglang.srt.plugins", "load_plugins", "SGLANG_PLUGINS",
               "plugin:sglang"),
    "aphrodite": ("aphrodite-engine", "0.24.1", "aphrodite.plugins", "load_general_plugins",
                  "APHRODITE_PLUGINS", "plugin:aphrodite"),
}
OURS = "flashinfer_safe_workspace"  # the entry points' name, as a filter names it


def _load(engine: str, switch, allowed, *, import_comm: bool = False) -> dict:
    dist, version, module, function, filter_var, _ = LOADERS[engine]
    root = engine_root(dist, version)
    env = harness.clean_env()
    for name in [v[4] for v in LOADERS.values()]:
        env.pop(name, None)
    if switch is not None:
        env["FLASHINFER_SAFE_WORKSPACE"] = switch
    if allowed is not None:
        env[filter_var] = allowed
    env["PYTHONPATH"] = os.pathsep.join([str(root), *package_dirs(), env["PYTHONPATH"]])
    code = (f"import importlib; importlib.import_module({module!r}).{function}()\n"
            + ("import flashinfer.comm\n" if import_comm else "")
            + REPORT.replace('"heavy": _heavy}', '"heavy": _heavy, "wrapped": __import__('
                             '"flashinfer_safe_workspace.activation.patch", fromlist=["x"])'
                             '.wrapped_bindings()}'))
    proc = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])


@pytest.mark.parametrize("engine", list(LOADERS))
def test_plugin_loader_activates_when_the_variable_is_on(engine):
    out = _load(engine, "1", None)
    assert out["by"] == LOADERS[engine][5] and out["watching"]
    assert out["heavy"] == []  # the plugin defers everything to the first import of flashinfer


@pytest.mark.parametrize("engine", list(LOADERS))
def test_plugin_loader_named_in_the_filter_activates(engine):
    out = _load(engine, "1", OURS)
    assert out["by"] == LOADERS[engine][5]


@pytest.mark.parametrize("engine", list(LOADERS))
def test_plugin_filtered_out_is_never_loaded(engine):
    out = _load(engine, "1", "some_other_plugin")
    assert out["by"] is None and not out["watching"]
    assert out["ours"] == []  # the loader never imported our entry point


@pytest.mark.parametrize("engine", list(LOADERS))
def test_plugin_loaded_with_the_variable_unset_does_nothing(engine):
    out = _load(engine, None, None)
    assert out["by"] is None and not out["watching"] and not out["hooks"]
    assert "flashinfer_safe_workspace.activation.gate" in out["ours"]  # it was loaded
    assert "flashinfer_safe_workspace.activation.bootstrap" not in out["ours"]


def test_vllm_plugin_wraps_flashinfer_when_it_is_imported():
    out = _load("vllm", "1", None, import_comm=True)
    assert out["by"] == "plugin:vllm" and out["hooks"]
    assert len(out["wrapped"]) == 5, out["wrapped"]
