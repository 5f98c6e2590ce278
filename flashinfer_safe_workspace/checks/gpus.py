"""Mode 2 (second half): one GPU per rank where the release needs it.

A multicast object takes one device per rank (``cuMulticastAddDevice``): two ranks on
one GPU cannot fill it. Only paths that create a multicast object need distinct GPUs;
trtllm over shared GPUs works (0.7.4, measured) and stays allowed."""

from __future__ import annotations

from .. import _reasons as R
from .base import Failure, applying, group_by, ok

NAME = "gpus"
CODE = R.SHARED_GPU
MODES = (2,)
RELEASES = "paths with a multicast object: mnnvl, mnnvl-cutedsl, auto before 0.6.16"


def applies(ctx) -> bool:
    return ctx.makes_multicast


def local(ctx):
    f = ctx.facts()
    return ok(f"gpu={f.host}|{f.gpu_uuid}")


def compare(records):
    groups = group_by(applying(records, NAME), lambda r: r.value)
    shared = tuple(g for g in groups if len(g[1]) > 1)
    if shared:
        return Failure(NAME, R.SHARED_GPU, "ranks share a GPU on a path that adds one "
                       "device per rank to a multicast object", shared)
    return None
