"""``planning/plan.py``: the plan's types and helpers, as functions over values."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace.planning import plan as P
from flashinfer_safe_workspace.planning.plan import MiB, Allocation, Facts, Plan


def test_units_and_defaults():
    assert MiB == 1 << 20
    assert (P.DEFAULT_GRANULARITY, P.DEFAULT_MC_GRANULARITY) == (2 * MiB, 512 * MiB)
    assert P.FALLBACK_TORCH_SIGNAL_PAD == 2048
    f = Facts()
    assert (f.granularity, f.multicast_granularity, f.torch_signal_pad) == (2 * MiB, 512 * MiB, 2048)
    assert (f.multicast_supported, f.multicast_all_ranks, f.fabric_supported) == (True, None, False)


@pytest.mark.parametrize("dtype,name", [
    (None, None), ("torch.bfloat16", "bfloat16"), ("float16", "float16"), ("torch.", ""),
    ("xtorch.float16", "xtorch.float16")])
def test_dtype_name(dtype, name):
    assert P.dtype_name(dtype) == name


def test_dtype_name_of_a_torch_dtype():
    import torch

    assert P.dtype_name(torch.float32) == "float32"
    assert all(P.ELEMENT_SIZE[n] == torch.empty(0, dtype=getattr(torch, n)).element_size()
               for n in P.ELEMENT_SIZE)


@pytest.mark.parametrize("value,multiple,expected", [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (2 * MiB + 1, 2 * MiB, 4 * MiB)])
def test_round_up(value, multiple, expected):
    assert P.round_up(value, multiple) == expected


def test_multicast_granularity_per_size():
    assert Facts(multicast_granularity=4 * MiB).gmc(1) == 4 * MiB
    rule = lambda size: 2 * MiB if size <= 2 * MiB else 0  # noqa: E731 - 0: no answer
    f = Facts(multicast_granularity=8 * MiB, multicast_granularity_for=rule)
    assert (f.gmc(2 * MiB), f.gmc(2 * MiB + 1)) == (2 * MiB, 8 * MiB)
    assert Facts(multicast_granularity_for=lambda s: "3").gmc(1) == 3


def plan(*allocs, **kw):
    base = dict(flashinfer_version="0.7.4", rules="R10", entry="unified", backend="trtllm",
                allocator="B4", handle_type="posix", device=None, allocations=tuple(allocs),
                world_size=2, dtype="bfloat16")
    base.update(kw)
    return Plan(**base)


A = Allocation("trtllm.buffer", 4 * MiB, "cuMemCreate", "posix", True, "f(a)")
T = Allocation("trtllm.retry", 2 * MiB, "cuMemCreate", "fabric", False, "f(t)")
L = Allocation("trtllm.flag", MiB, "cudaMalloc")


def test_peak_counts_held_allocations_only():
    p = plan(A, T, L)
    assert p.peak_bytes == 5 * MiB
    assert p.probe_allocations == (A, L)
    assert plan().peak_bytes == 0


def test_digest_covers_shape_not_rank_or_device():
    p = plan(A, L)
    assert p.digest() == plan(A, L, device=3, handle_type="fabric", rules="R9").digest()
    assert 0 <= p.digest() < 1 << 62
    for other in (plan(A), plan(L, A), plan(A, L, world_size=4), plan(A, L, dtype="float16"),
                  plan(A, L, backend="mnnvl"), plan(A, L, entry="legacy"),
                  plan(A, L, flashinfer_version="0.7.2"),
                  plan(A, P.dataclasses.replace(L, bytes=2 * MiB)),
                  plan(A, P.dataclasses.replace(L, name="x")),
                  plan(A, P.dataclasses.replace(L, api="cuMemAlloc"))):
        assert other.digest() != p.digest()


def test_json_and_description():
    p = plan(A, T, device=1, notes=("n1",))
    assert p.to_json() == {
        "flashinfer_version": "0.7.4", "rules": "R10", "entry": "unified", "backend": "trtllm",
        "allocator": "B4", "handle_type": "posix", "device": 1, "peak_bytes": 4 * MiB,
        "allocations": [
            {"name": "trtllm.buffer", "bytes": 4 * MiB, "api": "cuMemCreate",
             "handle_type": "posix", "held": True, "formula": "f(a)"},
            {"name": "trtllm.retry", "bytes": 2 * MiB, "api": "cuMemCreate",
             "handle_type": "fabric", "held": False, "formula": "f(t)"}]}
    lines = p.describe().splitlines()
    assert lines[0] == ("FlashInfer 0.7.4 (R10), unified entry, backend trtllm, allocator B4, "
                        "handle posix, device 1")
    assert lines[1] == f"  {'trtllm.buffer':<22} {4.0:>12.3f} MiB  {'cuMemCreate':<11} f(a)"
    assert lines[2].endswith("f(t)  (transient)")
    assert lines[3] == f"  {'peak held':<22} {4.0:>12.3f} MiB"
    assert lines[4] == "  note: n1"
    assert len(lines) == 5
    assert plan(handle_type=None).describe().splitlines()[0].endswith("handle -, device current")


def test_pass_through_and_unplanned():
    assert P.PassThrough("why").reason == "why"
    assert issubclass(P.Unplanned, Exception)
