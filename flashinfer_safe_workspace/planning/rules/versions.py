"""FlashInfer releases, ranges and per-range traits; the one FlashInfer version lookup.

Each FlashInfer release belongs to one range (R0–R10, named as in the project's
reference notes on FlashInfer's allocations). A range fixes the buffer-size formulas,
the allocator of each entry point, their rounding, the handle type and the device;
:class:`Traits` holds what differs between ranges, as data.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Optional

from ..plan import Unplanned

NEWEST = (0, 7, 4, 0)

# (first release of the range, label), in order; a release belongs to the last range
# whose first release is <= it.
RANGES = (
    ((0, 5, 0, 0), "R0"),
    ((0, 6, 0, 0), "R1"),
    ((0, 6, 7, 0), "R2"),
    ((0, 6, 10, 0), "R3"),
    ((0, 6, 10, 1), "R4"),
    ((0, 6, 15, 0), "R5"),
    ((0, 6, 16, 0), "R6"),
    ((0, 6, 18, 0), "R7"),
    ((0, 7, 2, 0), "R8"),
    ((0, 7, 2, 1), "R9"),
    ((0, 7, 4, 0), "R10"),
)


_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?")


def parse_version(text: str) -> tuple:
    """``"0.7.2.post1"`` -> ``(0, 7, 2, 1)``; pre-release and local tags are ignored."""
    match = _VERSION_RE.match(str(text))
    if not match:
        raise Unplanned(f"cannot parse FlashInfer version {text!r}")
    major, minor, micro, post = match.groups()
    return (int(major), int(minor), int(micro or 0), int(post or 0))


def range_of(version: str) -> str:
    """The range label (``"R0"`` … ``"R10"``) whose rules apply to ``version``.

    Releases newer than the newest one read use the newest rules (see is_unknown)."""
    key = parse_version(version)
    if key < RANGES[0][0]:
        raise Unplanned(f"FlashInfer {version} is older than 0.5.0; no rules")
    label = RANGES[0][1]
    for first, name in RANGES:
        if key >= first:
            label = name
    return label


def is_unknown(version: str) -> bool:
    """Newer than the newest release whose rules were read (its plan uses R10's rules)."""
    return parse_version(version)[:3] > NEWEST[:3]



def flashinfer_version() -> Optional[str]:
    """The FlashInfer release this process plans for: the imported module's
    ``__version__``, else the installed distribution's version, else ``None`` (not
    installed: callers say so instead of assuming a release)."""
    module = sys.modules.get("flashinfer")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import PackageNotFoundError, version as dist_version
        except ImportError:  # pragma: no cover - stdlib since 3.8
            return None
        try:
            version = dist_version("flashinfer-python")
        except PackageNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - broken metadata: as good as not installed
            return None
    return str(version)


def _rank_index(label: str) -> int:
    return int(label[1:])


# --------------------------------------------------------------------------- per range


@dataclasses.dataclass(frozen=True)
class Traits:
    """What differs between ranges, as data."""

    label: str
    unified: bool  # create_allreduce_fusion_workspace exists (0.6.0+)
    auto_vote: bool  # auto = group multicast vote (0.6.16+); before: always mnnvl
    confidential_compute: bool  # is_confidential_compute() is consulted (0.6.16+)
    trtllm: str  # allocator of the unified trtllm workspace (non-CC)
    legacy_default: str  # allocator of the legacy function with use_symm_dev_mem=False
    legacy_symm: Optional[str]  # ... with use_symm_dev_mem=True (None: no such parameter)
    mnnvl: str  # allocator of the mnnvl workspace
    trtllm_device_is_rank: bool  # 0.6.0–0.6.6: trtllm SymmDeviceMemory on cuda:tp_rank
    mnnvl_device_is_local_rank: bool  # 0.6.0–0.6.6: mnnvl on rank % gpus_per_node
    wide_fp32_buffer: bool  # 0.7.2+: trtllm buffer B uses 4-byte elements for fp32
    mnnvl_round32: bool  # 0.6.18+: mnnvl per-buffer size rounded up to 32 bytes
    cutedsl_factory: bool  # "mnnvl-cutedsl" accepted by the factory (0.7.2.post1+)


def _traits(label: str) -> Traits:
    r = _rank_index(label)
    b = {5: "B2", 10: "B4"}.get(r, "B3" if r >= 6 else "B1")
    symm_alloc = "C" if r in (3, 4) else b
    return Traits(
        label=label,
        unified=r >= 1,
        auto_vote=r >= 6,
        confidential_compute=r >= 6,
        trtllm=symm_alloc,
        legacy_default="A" if r <= 2 else "C",
        legacy_symm=None if r == 0 else symm_alloc,
        mnnvl=symm_alloc,
        trtllm_device_is_rank=r == 1,
        mnnvl_device_is_local_rank=r == 1,
        wide_fp32_buffer=r >= 8,
        mnnvl_round32=r >= 7,
        cutedsl_factory=r >= 9,
    )


def traits(version: str) -> Traits:
    """The per-range traits of ``version`` (for callers and tests)."""
    return _traits(range_of(version))
