"""sitecustomize_example: activates the shim from PYTHONPATH and chains to the
sitecustomize it shadows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "sitecustomize_example"
CODE = ("import sys, json; print('OUT' + json.dumps({'ours': 'flashinfer_safe_workspace' in sys.modules,"
        " 'shadowed': getattr(sys, '_shadowed_ran', False),"
        " 'site': getattr(sys.modules.get('sitecustomize'), '__file__', '')}))")


def _run(tmp_path, value):
    other = tmp_path / "image_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys\nsys._shadowed_ran = True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(other), str(ROOT)])
    if value is not None:
        env["FLASHINFER_SAFE_WORKSPACE"] = value
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT")][-1][3:])


def test_on_activates_and_chains(tmp_path):
    out = _run(tmp_path, "1")
    assert Path(out["site"]).parent == EXAMPLE  # the example is the sitecustomize Python ran
    assert out["ours"] is True and out["shadowed"] is True


def test_off_still_chains_and_imports_nothing_of_ours(tmp_path):
    out = _run(tmp_path, None)
    assert out["shadowed"] is True
    # the installed .pth (if any) is off too, so nothing of ours is imported
    assert out["ours"] is False
