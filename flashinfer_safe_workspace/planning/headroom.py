"""The headroom: how much device memory a rank must have free beyond the plan.

``HEADROOM_MB`` (parsed by ``_config``'s table) is either a number of MiB (that much, always) or
``auto``: a small reserve when FlashInfer's collectives for this call need no new GPU
memory, and the NCCL start-up reserve when they may start an NCCL communicator.

Where FlashInfer 0.7.4 (and 0.6.x, same structure) runs its collectives:

* ``comm_backend`` given, and the path uses it (unified trtllm/mnnvl/auto; the legacy
  function with ``use_symm_dev_mem=True``): its ``allgather``/``bcast``/``barrier``.
  FlashInfer's ``TorchDistBackend`` runs them on its ``_group`` (None: WORLD). SGLang's
  ``_FixedTorchDistBackend`` is a ``TorchDistBackend`` over the NCCL device group whose
  ``bcast`` alone goes over the gloo ``_cpu_group``, so it is judged by its ``_group``
  too (and by ``_cpu_group`` when that is not gloo). ``MPIBackend`` gathers pickled
  objects on the host. Any other backend: cannot be told.
* otherwise ``group`` (None: WORLD): ``TorchDistBackend(group)`` for the unified trtllm
  path and the auto vote, ``dist.barrier(group)`` and the symmetric-memory rendezvous
  for the legacy path; the unified mnnvl path without a comm_backend uses
  ``MPIBackend`` (host only).

A torch group whose backend names ``nccl`` (also ``cpu:gloo,cuda:nccl``: torch 2.13's
``dist.barrier`` picks the accelerator's backend) is *warm* when its ProcessGroupNCCL
already holds its communicator. That is read with ``ProcessGroup._get_backend(cuda)``
(a lookup: it never constructs a backend) and ``ProcessGroupNCCL._is_initialized()``
(true when its communicator map is non-empty and every communicator in it finished
initialising; it creates none). The binding is in torch's own tests from October 2024
(pytorch PR #138665), i.e. torch 2.6 and later; seen on the H200 with torch 2.11
(bench/results/audit.nccl-query-h200.txt: False for a lazy group, True after the first
collective or with ``device_id``, and asking moved free memory by 0 bytes). Where it is
missing, the state cannot be told and the NCCL reserve is used. A group bound to another device than the
current one (``bound_device_id``) cannot be told either.
"""

from __future__ import annotations

import sys
from typing import Any, Tuple

from .plan import MiB

# The small reserve: FlashInfer's first-load JIT module, the caching allocator's first
# segments for its small tables (2 MiB each) and the driver's tails, measured as the
# drop in free memory around a creation minus the plan: on the H200, for four shapes,
# 6 MiB at the first creation of a process and 0 MiB at later ones (docs/gpu-report.md,
# case q, which names its commit; `scripts/gpu-check --one-gpu`). 64 MiB keeps ten times that, for
# shapes, releases and drivers not measured: a tail that does not fit makes FlashInfer
# fail on one rank after the vote, which is the hang this library exists to prevent.
SMALL_RESERVE_MB = 64

# NCCL's lazy communicator start-up inside FlashInfer's first collective. On H200 a
# rank with 122 MiB left after the plan died there; 512 MiB is about twice that,
# until a two-GPU measurement replaces it. Note: a ONE-rank NCCL communicator's
# start-up took 650-652 MiB on the H200 with torch 2.11
# (bench/results/audit.nccl-query-h200.txt), more than this reserve.
NCCL_RESERVE_MB = 512

AUTO = "auto"
WHY = ("set", "gloo", "cpu-comm-backend", "nccl-warm", "nccl-cold", "unknown")
_SMALL = ("gloo", "cpu-comm-backend", "nccl-warm")


def resolve(setting: Any, *, entry: str, backend: str, group: Any, comm_backend: Any,
            use_symm_dev_mem: bool = False) -> Tuple[int, str]:
    """(headroom bytes, why) for one creation call; ``setting``: ``Settings.headroom_mb``
    (``auto`` or a whole number of MiB). Never raises: anything it cannot tell gives the
    NCCL reserve with ``why="unknown"``."""
    if setting != AUTO:
        return int(setting) * MiB, "set"
    try:
        why = classify(entry=entry, backend=backend, group=group, comm_backend=comm_backend,
                       use_symm_dev_mem=use_symm_dev_mem)
    except Exception:  # noqa: BLE001 - a surprise in torch's objects: be careful
        why = "unknown"
    return (SMALL_RESERVE_MB if why in _SMALL else NCCL_RESERVE_MB) * MiB, why


def classify(*, entry: str, backend: str, group: Any, comm_backend: Any,
             use_symm_dev_mem: bool = False) -> str:
    """Where FlashInfer's collectives for this call run: one of ``WHY`` but ``set``."""
    if comm_backend is not None and _uses_comm_backend(entry, backend, use_symm_dev_mem):
        return _classify_comm(comm_backend)
    if entry != "legacy" and backend == "mnnvl":
        return "cpu-comm-backend"  # FlashInfer builds an MPIBackend: host collectives
    return _classify_group(group, "gloo")


def _uses_comm_backend(entry: str, backend: str, use_symm_dev_mem: bool) -> bool:
    if entry == "legacy":
        return bool(use_symm_dev_mem)
    return backend != "mnnvl-cutedsl"  # it refuses comm_backend (a process group only)


def _classify_comm(comm: Any) -> str:
    attrs = vars(comm) if hasattr(comm, "__dict__") else {}
    if "_group" in attrs or "_cpu_group" in attrs:  # TorchDistBackend and its kin
        answers = []
        if "_group" in attrs:
            answers.append(_classify_group(attrs["_group"], "cpu-comm-backend"))
        cpu = attrs.get("_cpu_group")
        if cpu is not None:
            answers.append(_classify_group(cpu, "cpu-comm-backend"))
        return _worst(answers)
    if type(comm).__name__ == "MPIBackend" and type(comm).__module__.startswith("flashinfer"):
        return "cpu-comm-backend"
    return "unknown"


_ORDER = ("gloo", "cpu-comm-backend", "nccl-warm", "unknown", "nccl-cold")


def _worst(answers: list) -> str:
    """The answer that needs the most memory (cold or unknown over warm over CPU)."""
    return max(answers, key=_ORDER.index) if answers else "unknown"


def _classify_group(group: Any, cpu_label: str) -> str:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return "unknown"
    target = group if group is not None else dist.group.WORLD
    name = str(dist.get_backend(target)).lower()
    parts = {p.split(":")[-1].strip() for p in name.split(",")}
    if "nccl" in parts:
        state = nccl_communicator_ready(target)
        return "unknown" if state is None else ("nccl-warm" if state else "nccl-cold")
    if parts == {"gloo"}:
        return cpu_label
    return "unknown"


def nccl_communicator_ready(group: Any):
    """True/False: the group's ProcessGroupNCCL has / has not its communicator for this
    device; None: cannot be told. Read-only: creates no backend and no communicator."""
    try:
        import torch

        backend = group._get_backend(torch.device("cuda"))
        probe = getattr(backend, "_is_initialized", None)
        if probe is None:
            return None
        ready = bool(probe())
        if not ready:
            return False
        bound = getattr(group, "bound_device_id", None)
        if bound is not None and torch.cuda.is_initialized():
            if bound.index is not None and bound.index != torch.cuda.current_device():
                return None  # its communicator is for another device
        return True
    except Exception:  # noqa: BLE001 - a torch without these bindings
        return None
