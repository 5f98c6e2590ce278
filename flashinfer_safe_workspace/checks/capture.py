"""Mode 10: creation asked for while the current stream captures a CUDA graph.

No release checks for capture; creation's allocations, synchronisations and object
collectives break the capture, on some ranks first. A call during capture with no
decided answer in the veto cache is vetoed on every rank (the vote itself is CPU-only)."""

from __future__ import annotations

from .. import _reasons as R
from .base import every_release, fail, ok

NAME = "capture"
CODE = R.CAPTURING
MODES = (10,)
RELEASES = "every release (0.5.0–0.7.4)"


applies = every_release


def local(ctx):
    if ctx.facts().capturing:
        return fail(R.CAPTURING, "capturing=1",
                    "creation during CUDA graph capture breaks the capture (cudaMalloc, "
                    "synchronize and object collectives are not capturable); create the "
                    "workspace before capture")
    return ok("capturing=0")
