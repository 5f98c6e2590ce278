"""Reason codes: why a rank said no. Stable: they travel in records and appear in messages
and on the decision line, so a code is never reused for another meaning."""

OK = 0
OUT_OF_MEMORY = 1
PROBE_ERROR = 2
INTERNAL_ERROR = 3
UNPLANNED = 4
NO_DEVICE = 5
ARG_MISMATCH = 6
UNKNOWN_VERSION = 7
PASS_THROUGH = 8
INTERRUPTED = 9
DRIVER_ERROR = 10
ABSENT = 11
STORE_ERROR = 12
ABORTED = 13
INCOMPLETE = 14

REASON_TEXT = {
    OK: "ok",
    OUT_OF_MEMORY: "out of memory",
    PROBE_ERROR: "probe failed",
    INTERNAL_ERROR: "internal error",
    UNPLANNED: "no allocation rule for this call",
    NO_DEVICE: "no usable CUDA driver or device",
    ARG_MISMATCH: "arguments disagree with the group",
    UNKNOWN_VERSION: "FlashInfer release not mirrored",
    PASS_THROUGH: "FlashInfer rejects these arguments before allocating",
    INTERRUPTED: "interrupted",
    DRIVER_ERROR: "a CUDA driver query failed",
    ABSENT: "a rank did not answer in time",
    STORE_ERROR: "the c10d store did not answer",
    ABORTED: "the group aborted",
    INCOMPLETE: "the round did not complete",
}

NAMES = {code: name for name, code in sorted(globals().items())
         if name.isupper() and isinstance(code, int)}


def names(codes) -> tuple:
    """The codes' names (``OUT_OF_MEMORY``), sorted: the decision line's ``reasons=``."""
    return tuple(sorted(NAMES.get(c, str(c)) for c in codes))

