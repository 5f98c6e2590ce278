"""lmdeploy's real FlashInfer all-reduce (``lmdeploy/pytorch/backends/cuda/comm/
flashinfer_allreduce.py`` of its released wheel) under the shim's veto.

Two ranks over real gloo groups; rank 1's simulated GPU is short. lmdeploy creates
the workspace lazily on the first all-reduce of a process group, checks the result for
``None`` itself, and disables the backend on any exception. Stand-ins in
``engine_rank.py``.
"""

from __future__ import annotations

import pytest

from _runner import MODES, check_answers, check_doc, engine_root, messages, run_ranks

LOGGER = "lmdeploy"
CALLER = "lmdeploy.pytorch.backends.cuda.comm.flashinfer_allreduce"


@pytest.mark.parametrize("mode", MODES)
def test_lmdeploy_018_ends_non_fused(mode):
    root = engine_root("lmdeploy", "0.18.0")
    reports = run_ranks("lmdeploy", "0.18.0", root, [80 * 1024, 16])[mode]
    check_answers(reports, mode, CALLER)
    for rank, r in enumerate(reports):
        (d,) = r["decisions"]  # disabled after the first failure: never asks again
        assert d["outcome"] == "veto" and d["backend"] == "trtllm" and d["ranks"] == [0, 1]
        assert d["probe"] == "no" if rank == 1 else d["probe"] in ("ok", "-")  # "-": arrived after the no, followed it
        # all_reduce_ returns False: the caller runs its NCCL all-reduce (non-fused)
        assert r["all_reduce_first"] is False and r["all_reduce_second"] is False
        assert r["disabled"] is True and r["fused"] == "None"
        warnings = messages(r, LOGGER)
        if mode == "none":
            assert any("workspace creation returned None" in m for m in warnings)
        else:
            assert any("not created on any of ranks" in m for m in warnings)
        check_doc("lmdeploy", "0.18.0", mode, "non-fused")
