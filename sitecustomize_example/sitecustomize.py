"""Activate flashinfer_safe_workspace for deployments that put a directory on PYTHONPATH
instead of installing the wheel's ``.pth`` (for example a read-only image).

Copy this directory next to the package (or anywhere), add it to PYTHONPATH, set
FLASHINFER_SAFE_WORKSPACE=1. Python imports only the *first* ``sitecustomize`` on
``sys.path``, so this one finds and runs the one it shadows (the image's own) after
doing its part. Stdlib only until the variable says on; it never raises.
"""

import importlib.util
import os
import sys


def _activate():
    value = os.environ.get("FLASHINFER_SAFE_WORKSPACE", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    try:
        import flashinfer_safe_workspace  # noqa: F401  (activates on import)
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
