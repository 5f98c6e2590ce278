"""The plan: what one rank's workspace creation will allocate, before FlashInfer runs.

Pure Python (no torch, no CUDA): a :class:`Request` (the call's arguments, normalised)
plus :class:`Facts` (device and environment facts the rules depend on) go in; a
:class:`Plan` (ordered allocations, held vs transient) or a :class:`PassThrough`
(FlashInfer will reject these arguments itself, before allocating) comes out of
``rules.plan_for``. Types and the package's units only: this module imports nothing
from the rules (``rules`` imports it), and ``_facts`` fills :class:`Facts` from the
runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, Optional

MiB = 1 << 20  # the package's one MiB
DEFAULT_GRANULARITY = 2 * MiB  # measured on H200 (reference section 9)
DEFAULT_MC_GRANULARITY = 512 * MiB  # RECOMMENDED multicast granularity on H200, >= 4 MiB
# torch's symmetric-memory signal pad before torch had get_signal_pad_size(); the
# runtime value (9216 with torch 2.11+ and 2.13) comes from _facts.signal_pad().
FALLBACK_TORCH_SIGNAL_PAD = 2048

# Element sizes of torch dtypes, by name without "torch.".
ELEMENT_SIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4,
    "float64": 8, "int64": 8, "uint64": 8, "complex64": 8,
    "int32": 4, "uint32": 4,
    "int16": 2, "uint16": 2,
    "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def dtype_name(dtype) -> Optional[str]:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``;
    ``None`` stays ``None``. The one dtype normaliser of the package."""
    if dtype is None:
        return None
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


class Unplanned(Exception):
    """The rules cannot say what this call allocates (our limitation, not FlashInfer's)."""



def digest(obj) -> str:
    """The wire's short digest of a JSON-able value (a call's arguments, a rank set):
    equal on every rank for equal values, whatever the key order."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

@dataclasses.dataclass(frozen=True)
class Request:
    """One creation call, normalised from FlashInfer's signature."""

    entry: str  # "unified" (create_allreduce_fusion_workspace) | "legacy" (trtllm_create_ipc_…_fusion)
    backend: str  # as passed: trtllm | mnnvl | mnnvl-cutedsl | auto (legacy: "trtllm")
    world_size: Any
    rank: Any
    max_token_num: Any
    hidden_dim: Any
    dtype: Optional[str] = None  # "bfloat16" | "float16" | "float32" | other torch name | None
    force_oneshot_support: bool = False
    gpus_per_node: Optional[int] = None
    use_fp32_lamport: bool = False  # legacy only
    use_symm_dev_mem: bool = False  # legacy only
    create_metadata: bool = False  # legacy only
    has_comm_backend: bool = False
    cutedsl_options: tuple = ()  # sorted (name, repr) pairs of the keyword-only options
    # The same options' values, (name, value) pairs (mnnvl-cutedsl: a custom ``config``
    # object cannot be planned from its repr). Not compared: the reprs stand for them.
    cutedsl_values: tuple = dataclasses.field(default=(), compare=False, hash=False,
                                              repr=False)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the rules need to know about this rank's device and environment."""

    granularity: int = DEFAULT_GRANULARITY  # cuMemGetAllocationGranularity (RECOMMENDED)
    multicast_granularity: int = DEFAULT_MC_GRANULARITY
    fabric_supported: bool = False  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
    fabric_nvml_ok: bool = False  # NVML fabric state completed with a cluster UUID (B1–B3)
    multicast_supported: bool = True  # this rank's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
    multicast_all_ranks: Optional[bool] = None  # group-wide answer (auto, 0.6.16+)
    confidential_compute: bool = False
    current_device: int = 0
    device_count: int = 1
    # torch symmetric memory's signal pad (allocator C); runtime value: _facts.signal_pad()
    torch_signal_pad: int = FALLBACK_TORCH_SIGNAL_PAD
    compute_capability: tuple = (9, 0)
    # An IMEX channel is usable, so FABRIC handles can be exported. Without one,
    # 0.7.4 retries each FABRIC allocation with POSIX fds (a transient FABRIC
    # cuMemCreate of the same size) and 0.6.x–0.7.2 fail at the export.
    imex_channel: bool = False
    # The driver's RECOMMENDED multicast granularity depends on the object's size (on H200:
    # 2 MiB for a 2 MiB object, 512 MiB for larger ones). FlashInfer asks it for each
    # object it rounds, with that object's size; where set, this answers the same
    # question (size -> granularity), else ``multicast_granularity`` is used for every size.
    multicast_granularity_for: Optional[Callable[[int], int]] = dataclasses.field(
        default=None, compare=False, hash=False, repr=False)

    def gmc(self, size: int) -> int:
        if self.multicast_granularity_for is not None:
            answer = self.multicast_granularity_for(size)
            if answer:
                return int(answer)
        return self.multicast_granularity


@dataclasses.dataclass(frozen=True)
class Allocation:
    name: str  # e.g. "trtllm.buffer"
    bytes: int  # bytes asked of the allocator (after every rounding FlashInfer/torch apply)
    api: str  # "cuMemCreate" | "cudaMalloc" | "cuMemAlloc" | "torch"
    handle_type: Optional[str] = None  # "posix" | "fabric" for cuMemCreate
    held: bool = True  # False: released again before creation ends (a failed attempt)
    formula: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "api": self.api,
                "handle_type": self.handle_type, "held": self.held, "formula": self.formula}


@dataclasses.dataclass(frozen=True)
class Plan:
    flashinfer_version: str
    rules: str  # range label, e.g. "R10"
    entry: str
    backend: str  # resolved backend
    allocator: str  # "A", "B1".."B4", "C", "D"
    handle_type: Optional[str]
    device: Optional[int]  # CUDA ordinal FlashInfer allocates on (None: current device)
    allocations: tuple  # of Allocation, in FlashInfer's order
    world_size: int = 0
    dtype: Optional[str] = None
    notes: tuple = ()

    @property
    def peak_bytes(self) -> int:
        return sum(a.bytes for a in self.allocations if a.held)

    @property
    def probe_allocations(self) -> tuple:
        """Held allocations the probe must create at once (transients need no extra room
        because each is released before the next allocation of the same size class)."""
        return tuple(a for a in self.allocations if a.held)

    def digest(self) -> int:
        """A 62-bit digest that equal arguments give on every rank.

        Covers backend, world size, dtype and every allocation size: ranks whose digests
        differ called with different shapes (the rank index is not part of it)."""
        text = json.dumps([self.flashinfer_version, self.entry, self.backend, self.world_size,
                           self.dtype, [(a.name, a.bytes, a.api) for a in self.allocations]])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2

    def to_json(self) -> dict:
        return {
            "flashinfer_version": self.flashinfer_version,
            "rules": self.rules,
            "entry": self.entry,
            "backend": self.backend,
            "allocator": self.allocator,
            "handle_type": self.handle_type,
            "device": self.device,
            "allocations": [a.to_json() for a in self.allocations],
            "peak_bytes": self.peak_bytes,
        }

    def describe(self) -> str:
        lines = [f"FlashInfer {self.flashinfer_version} ({self.rules}), {self.entry} entry, "
                 f"backend {self.backend}, allocator {self.allocator}, handle "
                 f"{self.handle_type or '-'}, device "
                 f"{'current' if self.device is None else self.device}"]
        for a in self.allocations:
            held = "" if a.held else "  (transient)"
            lines.append(f"  {a.name:<22} {a.bytes / MiB:>12.3f} MiB  {a.api:<11} "
                         f"{a.formula}{held}")
        lines.append(f"  {'peak held':<22} {self.peak_bytes / MiB:>12.3f} MiB")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class PassThrough:
    """FlashInfer rejects these arguments before allocating: let it say so itself."""

    reason: str


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple

