"""Mode 7: the memory handle type, chosen per rank, agreed across ranks; IMEX for FABRIC.

0.6.0–0.7.2.post1 (allocators B1–B3) choose FABRIC or POSIX fd on each rank alone
(driver attribute, NVML state and cluster UUID), with no vote: ranks choosing
differently run different exchanges. FABRIC export needs an IMEX channel (else
CUDA_ERROR_NOT_PERMITTED, on that rank). 0.7.4 votes and falls back itself."""

from __future__ import annotations

from .. import _reasons as R
from .base import by_field, differ, fail, handle_of, ok

NAME = "handles"
CODE = R.HANDLE_MISMATCH
MODES = (7,)
RELEASES = "0.6.0–0.7.2.post1 (allocators B1, B2, B3)"


def applies(ctx) -> bool:
    return ctx.allocator in ("B1", "B2", "B3")


def local(ctx):
    handle = handle_of(ctx)
    imex = ctx.facts().imex_channel
    value = f"handle={handle} imex={int(imex)}"
    if handle == "fabric" and not imex:
        return fail(R.NO_IMEX, value, "FlashInfer picks FABRIC handles here but no IMEX "
                    "channel is accessible (/dev/nvidia-caps-imex-channels/channel0): the "
                    "export fails with CUDA_ERROR_NOT_PERMITTED")
    return ok(value)


def compare(records):
    return differ(records, NAME, by_field("handle"), R.HANDLE_MISMATCH,
                  "ranks would choose different handle types (different exchanges: a hang)")
