"""Activate flashinfer_safe_workspace for deployments that put a directory on PYTHONPATH
instead of installing the wheel's ``.pth`` (for example a read-only image).

Copy this directory next to the package (or anywhere), add it to PYTHONPATH, set
FLASHINFER_SAFE_WORKSPACE=1. Python imports only the *first* ``sitecustomize`` on
``sys.path``, so this one finds and runs the one it shadows (the image's own) after
doing its part. With the variable absent it imports nothing of ours; otherwise the
package's gate decides (the same one the ``.pth``, ``.start`` and plugin paths call). It
never raises.
"""

import importlib.util
import os
import sys


def _activate():
    if "FLASHINFER_SAFE_WORKSPACE" not in os.environ:
        return
    try:
        from flashinfer_safe_workspace.activation import gate

        gate.from_sitecustomize()
    except Exception as exc:  # never break interpreter start-up
        sys.stderr.write(f"flashinfer_safe_workspace: sitecustomize could not activate: {exc}\n")


def _chain():
    """Run the sitecustomize that this file shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                sys.stderr.write(f"sitecustomize chained from {candidate} failed: {exc}\n")
            return


_activate()
_chain()
