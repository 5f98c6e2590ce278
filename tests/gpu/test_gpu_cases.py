"""The GPU claims of issue 4 as pytest tests: two rank processes per case, rank r on cuda:r.

Skipped unless two CUDA GPUs are visible (CI has none). On the GPU host the whole set
runs in one bounded command as ``scripts/gpu-check``, which shares this code
(``gpucheck_cases``) and writes the report; these tests are for running one claim at a
time there, e.g. ``pytest tests/gpu -m gpu -k positive``.

Host rules kept by the code they call: NVLink multicast off in every process
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), only
backend="trtllm" and the legacy function, no cuMulticastCreate, every wait bounded.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpucheck_cases as gcc  # noqa: E402


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver means no GPU test
        return 0


GPUS = _gpu_count()

pytestmark = [pytest.mark.gpu]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA GPUs (found {GPUS}); on the GPU "
                                               "host run scripts/gpu-check or pytest tests/gpu -m gpu")
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; on the GPU host run "
                                              "scripts/gpu-check --one-gpu")


@pytest.fixture(scope="module")
def ctx():
    lines = []
    return gcc.Ctx(deadline=time.monotonic() + 3600, log=lines.append)


@pytest.fixture(scope="module")
def shared_ctx():
    """Two ranks on cuda:0 over a gloo WORLD (the one-GPU profile)."""
    lines = []
    c = gcc.Ctx(deadline=time.monotonic() + 3600, log=lines.append, shared_device=True)
    yield c
    c.cleanup()


@one_gpu
def test_p_protocol_through_the_pth_on_one_gpu(shared_ctx):
    """ON_VETO none / raise / auto from plain and engine-named callers: the same answer on
    every rank within 50 ms, 0 bytes left by a veto (what each rank holds, not the shared
    GPU's free memory)."""
    result = gcc.run_case("p", shared_ctx)
    assert result["status"] == "pass", _explain(result)


@one_gpu
def test_q_audit_ok_and_tails_on_one_gpu(shared_ctx):
    """audit=ok for four new shapes; first-creation and later tails measured."""
    result = gcc.run_case("q", shared_ctx)
    assert result["status"] == "pass", _explain(result)


def _explain(result: dict) -> str:
    out = [f"{result['status']}: {result['summary']}"]
    out += [f"  check failed: {c['name']}: {c['detail'][:500]}" for c in result["checks"]
            if not c["ok"] and c.get("required", True)]
    out += [f"  error: {str(e)[:800]}" for e in result.get("errors", [])]
    for run in result.get("runs", []):
        for r in run["ranks"]:
            if r["stderr_tail"]:
                out.append(f"  [{run['tag']} rank {r['rank']} stderr] " + " | ".join(r["stderr_tail"][-5:]))
    return "\n".join(out)


@two_gpus
def test_a_positive_workspace_and_fused_allreduce_are_correct(ctx):
    """Shim on, room on both ranks: a real trtllm workspace; kAllReduce and
    kARResidualRMSNorm agree with float64 within bf16 rounding."""
    result = gcc.run_case("a", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_h_pth_activation_with_only_the_environment_variable(ctx):
    """Installed wheel + FLASHINFER_SAFE_WORKSPACE=1, no import of the shim in the
    script: FlashInfer's functions come wrapped; room -> workspace, starved -> None."""
    result = gcc.run_case("h", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_b_starved_rank_gets_none_or_workspacevetoed_on_every_rank(ctx):
    """Cold and warm NCCL: None (default) and WorkspaceVetoed (raise) on every rank."""
    result = gcc.run_case("b", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_c_flashinfer_alone_is_recorded_within_the_bound(ctx):
    """No shim: FlashInfer 0.7.4's own behaviour (hang with cold NCCL, exception with
    warm NCCL) is recorded, each run bounded at 60 s. The 'before' column."""
    result = gcc.run_case("c", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_e_recorded_allocations_equal_the_plan(ctx):
    """Every cuMemCreate (size, handle type, FABRIC attempt), cuMemAlloc and cudaMalloc
    FlashInfer makes equals the plan, for six shapes and both entry points."""
    result = gcc.run_case("e", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_f_no_leak(ctx):
    """A vetoed call leaves nothing allocated by either rank; create + full release returns
    the free memory."""
    result = gcc.run_case("f", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_g_overhead_is_measured(ctx):
    """>= 20 creations each with the shim on and off, and >= 20 vetoed calls."""
    result = gcc.run_case("g", ctx)
    assert result["status"] == "pass", _explain(result)


@two_gpus
def test_d_boundary_sweep_has_no_false_pass(ctx):
    """Around plan peak + headroom (headroom 0): whenever the shim lets the call
    through, FlashInfer succeeds; every rank gets the same decision."""
    result = gcc.run_case("d", ctx)
    assert result["status"] == "pass", _explain(result)
