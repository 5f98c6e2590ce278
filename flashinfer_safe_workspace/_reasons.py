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
STEP_TIMEOUT = 15  # this rank's plan, facts, a check or the probe ran past the deadline
# the preflight checks (flashinfer_safe_workspace/checks/); numbered from 20 on
CHECK_ERROR = 20
DEVICE_MISMATCH = 21
SHARED_GPU = 22
NO_MULTICAST = 23
CONFIDENTIAL_COMPUTE = 24
FABRIC_NOT_READY = 25
HOSTS_SPAN = 26
HANDLE_MISMATCH = 27
NO_IMEX = 28
CAPTURING = 29
PACKAGE_MISMATCH = 30
DEEP_PROBE_FAILED = 31
RENDEZVOUS_GROUP = 32

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
    STEP_TIMEOUT: "a step of this rank's decision (plan, facts, a check, the probe) did not return in time",
    CHECK_ERROR: "a preflight check could not run",
    DEVICE_MISMATCH: "the release would allocate on another device than the current one",
    SHARED_GPU: "two ranks on one GPU where the release needs one GPU per rank",
    NO_MULTICAST: "no NVLink multicast on a path that creates a multicast object",
    CONFIDENTIAL_COMPUTE: "confidential computing (multicast disabled, or ranks disagree)",
    FABRIC_NOT_READY: "the NVLink fabric is not ready (NVML fabric state)",
    HOSTS_SPAN: "the ranks span hosts on a single-host transport",
    HANDLE_MISMATCH: "the ranks would choose different memory handle types",
    NO_IMEX: "FABRIC handles chosen without an IMEX channel",
    CAPTURING: "called during CUDA graph capture",
    PACKAGE_MISMATCH: "flashinfer-cubin / flashinfer-jit-cache do not match flashinfer-python",
    DEEP_PROBE_FAILED: "a peer could not import this rank's memory handle (deep probe)",
    RENDEZVOUS_GROUP: "FlashInfer would rendezvous on a group other than the call's ranks",
}

NAMES = {code: name for name, code in sorted(globals().items())
         if name.isupper() and isinstance(code, int)}


def names(codes) -> tuple:
    """The codes' names (``OUT_OF_MEMORY``), sorted: the decision line's ``reasons=``."""
    return tuple(sorted(NAMES.get(c, str(c)) for c in codes))

