"""Runtime facts: every fact a rule depends on, taken from the runtime where it exists.

- torch's symmetric-memory signal pad from the installed torch
  (``torch.distributed._symmetric_memory.get_signal_pad_size()``; 2048 only for a
  torch without the query, logged once);
- the allocation granularity and the device attributes from the prober (the CUDA
  driver, or the simulated device);
- the multicast granularity asked of the prober for each object's own size, as
  FlashInfer asks the driver (on H200: 2 MiB for a 2 MiB object, 512 MiB from 4 MiB up).

``h200_facts`` gives the H200 values for callers without a GPU (the ``plan`` command).
Nothing here touches CUDA at import time; torch is imported only when asked.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional

from .._log import logger
from .plan import (
    DEFAULT_GRANULARITY,
    DEFAULT_MC_GRANULARITY,
    FALLBACK_TORCH_SIGNAL_PAD,
    Facts,
    MiB,
)

# H200, measured with scripts/mc-granularity (docs/gpu/mc-granularity-*.jsonl, POSIX and
# FABRIC, 2 and 8 devices): RECOMMENDED multicast granularity 2 MiB for a 2 MiB
# object, 512 MiB for 4 MiB and every larger size measured.
H200_SMALL_OBJECT = 2 * MiB
H200_SMALL_MC_GRANULARITY = 2 * MiB

_fallback_logged = False
_fallback_lock = threading.Lock()


def signal_pad() -> "tuple[int, str]":
    """(bytes, source) of torch's symmetric-memory signal pad in this process.

    Asked each time (``set_signal_pad_size`` can change it); the fallback is logged
    once per process. Never raises."""
    try:
        import torch
        from torch.distributed import _symmetric_memory as symm
    except Exception as exc:  # noqa: BLE001 - no torch, or no symmetric memory in it
        return _fallback(f"torch.distributed._symmetric_memory not importable "
                         f"({type(exc).__name__}: {exc})")
    query = getattr(symm, "get_signal_pad_size", None)
    if query is None:
        return _fallback(f"torch {torch.__version__} has no get_signal_pad_size()")
    try:
        pad = int(query())
    except Exception as exc:  # noqa: BLE001 - a torch build whose query fails
        return _fallback(f"torch {torch.__version__} get_signal_pad_size() failed: "
                         f"{type(exc).__name__}: {exc}")
    return pad, f"torch {torch.__version__} get_signal_pad_size()"


def _fallback(why: str) -> "tuple[int, str]":
    global _fallback_logged
    with _fallback_lock:
        first, _fallback_logged = not _fallback_logged, True
    if first:
        logger.warning("flashinfer_safe_workspace: %s; planning torch symmetric memory with "
                       "the signal pad of older torch releases, %d bytes",
                       why, FALLBACK_TORCH_SIGNAL_PAD)
    return FALLBACK_TORCH_SIGNAL_PAD, f"fallback {FALLBACK_TORCH_SIGNAL_PAD}: {why}"


class MulticastRule:
    """size -> multicast granularity, asked once per size and remembered (the answers
    are what ``check``/``doctor`` print as the facts used)."""

    def __init__(self, query: Callable[[int], Optional[int]], source: str):
        self._query = query
        self.source = source
        self.answers: dict = {}

    def __call__(self, size: int) -> Optional[int]:
        if size not in self.answers:
            self.answers[size] = self._query(size)
        return self.answers[size]


def h200_multicast_granularity(size: int) -> int:
    return H200_SMALL_MC_GRANULARITY if size <= H200_SMALL_OBJECT else DEFAULT_MC_GRANULARITY


def size_aware_multicast(facts: Facts, prober, world_size: int,
                         device: Optional[int] = None) -> Facts:
    """``facts`` whose multicast granularity is asked of ``prober`` per object size
    (``prober.multicast_granularity(device, world_size, size, handle)``); unchanged
    for a prober without the query."""
    query = getattr(prober, "multicast_granularity", None)
    if query is None:
        return facts
    fabric = facts.fabric_supported and getattr(facts, "imex_channel", False)
    handle = "fabric" if fabric else "posix"
    rule = MulticastRule(lambda size: query(device, world_size, size, handle),
                         f"{getattr(prober, 'name', type(prober).__name__)} per object size")
    return dataclasses.replace(facts, multicast_granularity_for=rule)


def runtime_facts(prober, *, device: Optional[int] = None, confidential_compute: bool,
                  world_size: int) -> Facts:
    """The facts the shim plans with on this rank: ``prober.facts(...)``, torch's real
    signal pad, and the multicast granularity per object size. Raises what
    ``prober.facts`` raises (``_probe.ProbeUnavailable`` without a driver)."""
    facts = prober.facts(device, confidential_compute, world_size)
    pad, _ = signal_pad()
    facts = dataclasses.replace(facts, torch_signal_pad=pad)
    return size_aware_multicast(facts, prober, world_size, device)


def h200_facts(world_size: int, *, torch_signal_pad: Optional[int] = None) -> Facts:
    """An H200 (POSIX handles, multicast, no confidential compute) with the installed
    torch's signal pad unless one is given: the facts without a GPU. ``world_size`` is
    the multicast object's device count (the measured answers are the same for 2 and
    8 devices)."""
    del world_size  # the H200 answers do not depend on it (measured for 2 and 8)
    pad = signal_pad()[0] if torch_signal_pad is None else int(torch_signal_pad)
    return Facts(granularity=DEFAULT_GRANULARITY, multicast_granularity=DEFAULT_MC_GRANULARITY,
                 torch_signal_pad=pad,
                 multicast_granularity_for=MulticastRule(h200_multicast_granularity,
                                                         "H200 rule (measured)"))


def describe(facts: Facts, *, pad_source: str = "", source: str = "") -> dict:
    """The facts a plan was made with, as a JSON-able dict (``check``, ``doctor``,
    ``plan`` print it). Multicast answers are those asked so far, by object size."""
    rule = facts.multicast_granularity_for
    out = {
        "source": source,
        "granularity": facts.granularity,
        "multicast_granularity": facts.multicast_granularity,
        "multicast_rule": getattr(rule, "source", None) if rule is not None else "fixed",
        "multicast_granularity_by_size": {str(k): v for k, v in
                                          sorted(getattr(rule, "answers", {}).items())},
        "torch_signal_pad": facts.torch_signal_pad,
        "torch_signal_pad_source": pad_source,
        "multicast_supported": facts.multicast_supported,
        "fabric_supported": facts.fabric_supported,
        "confidential_compute": facts.confidential_compute,
        "current_device": facts.current_device,
        "compute_capability": list(facts.compute_capability),
    }
    return out


def format_facts(d: dict) -> str:
    """One line for humans from :func:`describe`'s dict."""
    def mib(n):
        return f"{n / MiB:g} MiB" if n is not None else "-"

    sizes = d.get("multicast_granularity_by_size") or {}
    if d.get("multicast_rule") == "fixed":
        mc = f"multicast granularity {mib(d['multicast_granularity'])} for every object"
    elif sizes:
        mc = ("multicast granularity per object size (" + d["multicast_rule"] + "): "
              + ", ".join(f"{mib(int(k))} -> {mib(v)}" for k, v in sizes.items()))
    else:
        mc = f"multicast granularity per object size ({d['multicast_rule']}), none asked"
    src = f" [{d['source']}]" if d.get("source") else ""
    return (f"facts{src}: granularity {mib(d['granularity'])}; {mc}; torch signal pad "
            f"{d['torch_signal_pad']} B ({d['torch_signal_pad_source'] or 'given'})")
