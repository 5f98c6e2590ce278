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


# A PEP 440 version, loosely spelled (``v0.7.2post1``, ``0.7.2-1``): its release, its post
# number, and whether it has a pre-release, development or local part.
_PEP440 = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)+)"
    r"(?P<pre>[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?:-(?P<implicit>\d+)|[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?"
    r"(?P<dev>[-_.]?dev[-_.]?\d*)?"
    r"(?P<local>\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?\s*$", re.IGNORECASE | re.ASCII)
_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?", re.ASCII)
# re.ASCII: digits are 0-9 only (without it \d takes '٧' and '𝟠', and IGNORECASE takes the
# Kelvin sign for k); int() would read those too.


def is_version(text: str) -> bool:
    """``text`` is a version in PEP 440 spelling, as ``parse_version`` reads it exactly
    (not through its loose prefix): what the command line accepts."""
    return _PEP440.match(str(text)) is not None


def parse_version(text: str) -> tuple:
    """``"0.7.2.post1"`` -> ``(0, 7, 2, 1)``; pre-release and local tags are ignored."""
    strict = _PEP440.match(str(text))
    if strict:  # every PEP 440 spelling of a post release (0.7.2-1, 0.7.2-post1)
        parts = [int(p) for p in strict["release"].split(".")] + [0, 0]
        post = strict["implicit"] or strict["post"] or 0
        return (parts[0], parts[1], parts[2], int(post))
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


# The releases whose source the rules were written from (the project's reference notes on
# FlashInfer's allocations, section 0), as exact release strings. Read: the released wheels
# of 0.5.0 … 0.7.2.post1 that were downloaded and read, and an installed 0.7.4.
WHEELS_READ = (
    "0.5.0", "0.5.3", "0.6.0", "0.6.6", "0.6.7", "0.6.9", "0.6.10", "0.6.10.post1", "0.6.14",
    "0.6.15", "0.6.16", "0.6.16.post4", "0.6.17", "0.6.18", "0.6.18.post1", "0.7.0",
    "0.7.0.post1", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4",
)
# Tag-verified: read at their git tag, whose workspace files are byte-identical to the
# wheels' (the same check the notes made for every 0.5.x/0.6.x wheel against its tag).
TAGS_READ = (
    "0.5.1", "0.5.2", "0.6.1", "0.6.2", "0.6.3", "0.6.4", "0.6.5", "0.6.7.post1",
    "0.6.7.post2", "0.6.7.post3", "0.6.8", "0.6.8.post1", "0.6.11", "0.6.11.post1",
    "0.6.11.post2", "0.6.11.post3", "0.6.12", "0.6.13", "0.6.15.post1", "0.6.16.post1",
    "0.6.16.post2", "0.6.16.post3",
)
READ = frozenset(WHEELS_READ + TAGS_READ)


def canonical(text: str) -> Optional[str]:
    """``"v0.7.2post1"`` -> ``"0.7.2.post1"``: the release as the ``READ`` table spells it;
    ``None`` for a pre-release, a development or local build, or no version at all (their
    source is not a release that was read)."""
    match = _PEP440.match(str(text))
    if not match or match["pre"] or match["dev"] or match["local"]:
        return None
    parts = [int(p) for p in match["release"].split(".")]
    while len(parts) > 3 and parts[-1] == 0:  # 0.7.4.0 is 0.7.4
        parts.pop()
    parts += [0] * (3 - len(parts))
    post = match["implicit"] or match["post"]
    return ".".join(map(str, parts)) + (f".post{int(post or 0)}" if post is not None else "")


def is_unknown(version: str) -> bool:
    """True for a release whose source was not read (not in ``READ``): a newer release, a
    post or pre-release not read, a development or local build. Its plan uses the rules
    of the range it falls in (the newest for a newer release), and the runtime's
    ``UNKNOWN_VERSION`` setting decides. False for a release older than every rule (its
    plan is ``Unplanned``); raises ``Unplanned`` for text that is no version."""
    if parse_version(version) < RANGES[0][0]:
        return False
    return canonical(version) not in READ


def unverified_why(version: str) -> str:
    """What ``version`` is, when ``is_unknown``: a few words to follow "FlashInfer X is"."""
    if parse_version(version)[:3] > NEWEST[:3]:
        return f"newer than the newest release mirrored ({'.'.join(map(str, NEWEST[:3]))})"
    if not is_version(version):  # read through the loose prefix only
        release = ".".join(map(str, parse_version(version)[:3]))
        return f"not a PEP 440 version (read as {release}), not a release whose source was read"
    if canonical(version) is None:
        return "a pre-release, development or local build, not a release whose source was read"
    return "a release whose source was not read"


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
