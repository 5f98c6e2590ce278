"""Per-release allocation rules of FlashInfer's all-reduce fusion workspaces.

    versions    releases, ranges R0–R10, per-range traits, flashinfer_version()
    allocators  the rounding of allocators A, B1–B4 and C
    trtllm      the trtllm workspace (unified and legacy entry)
    mnnvl       the mnnvl workspace
    cutedsl     mnnvl-cutedsl, allocator D (the only module importing torch/FlashInfer)
    entry       plan_for(request, facts, version): THE entry point

The formulas are written from the project's reference notes on FlashInfer's
allocations, not copied code; the conformance test (tests/tools/test_conformance.py) runs
FlashInfer's real creation code against recording stand-ins and compares what it asks
for with these plans. Everything but ``cutedsl`` is pure Python (no torch, no CUDA).
"""

from __future__ import annotations

from .cutedsl import CUTEDSL_PLANNED_RANGES
from .entry import needs_group_multicast_vote, plan_for
from .trtllm import MAX_COMM_SIZE
from .versions import (
    NEWEST,
    RANGES,
    READ,
    Traits,
    flashinfer_version,
    is_unknown,
    parse_version,
    range_of,
    traits,
    unverified_why,
)

__all__ = [
    "CUTEDSL_PLANNED_RANGES", "MAX_COMM_SIZE", "NEWEST", "RANGES", "READ", "Traits",
    "flashinfer_version", "is_unknown", "needs_group_multicast_vote", "parse_version", "plan_for",
    "range_of", "traits", "unverified_why",
]
