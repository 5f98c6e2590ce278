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
}

