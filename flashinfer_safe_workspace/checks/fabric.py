"""Mode 5: the NVLink fabric (Fabric Manager / NVSwitch) ready, as NVML reports it.

Read with ``nvmlDeviceGetGpuFabricInfoV`` (nvidia-ml-py): a GPU without fabric info
passes; a fabric not started or in progress, or completed with a failed status, vetoes
every path that binds multicast or may pick FABRIC handles. FlashInfer never checks it
(0.6.0–0.7.2.post1 look at the state and the cluster UUID only, not the status)."""

from __future__ import annotations

from .. import _reasons as R
from .base import fail, ok

NAME = "fabric"
CODE = R.FABRIC_NOT_READY
MODES = (5,)
RELEASES = "mnnvl / auto / cutedsl (multicast bind) every release; FABRIC choice 0.6.0–0.7.2.post1"


def applies(ctx) -> bool:
    if ctx.makes_multicast:
        return True
    return ctx.allocator in ("B1", "B2", "B3") and ctx.facts().fabric_handles


def local(ctx):
    fab = ctx.facts().fabric
    if fab is None:
        return ok("fabric=none")
    value = fab.text()
    if fab.state < fab.COMPLETED:
        return fail(R.FABRIC_NOT_READY, value, "the GPU fabric is not started or still "
                    "forming (Fabric Manager / NVSwitch not ready)")
    if fab.status != 0:
        return fail(R.FABRIC_NOT_READY, value, f"fabric state completed with NVML status "
                    f"{fab.status} (not success)")
    return ok(value)
