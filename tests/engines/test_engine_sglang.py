"""SGLang's real workspace-creation code (from its released wheels) under the shim's veto.

Two ranks over real gloo groups. The code driven is
``sglang/srt/layers/flashinfer_comm_fusion.py`` of each release: the fused
all-reduce + residual + RMSNorm op, which creates the workspace through
``FlashInferWorkspaceManager.initialize`` on first use (0.5.23's runner warm-up calls
the same ``ensure_workspace_initialized``). Stand-ins and their reasons are in
``engine_rank.py``. FlashInfer is the installed release (SGLang 0.5.23 pins 0.7.2).
"""

from __future__ import annotations

import pytest

from _runner import MODES, check_answers, check_doc, engine_root, messages, run_ranks

LOGGER = "sglang.srt.layers.flashinfer_comm_fusion"


@pytest.fixture(scope="module")
def s0523():
    return engine_root("sglang", "0.5.23")


@pytest.mark.parametrize("mode", MODES)
def test_sglang_0523_ends_non_fused(s0523, mode):
    # SGLang >= 0.5.11 runs its own cuMemCreate preflight + BAND vote first (probing the
    # bare trtllm sizes, each rounded to the 512 MiB multicast granularity: 1.5 GiB
    # here). Rank 1 has 3000 MiB free: SGLang's preflight passes; the shim, asked to
    # keep 4 GiB of headroom, vetoes.
    reports = run_ranks("sglang", "0.5.23", s0523, [80 * 1024, 3000],
                        FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB="4096")[mode]
    check_answers(reports, mode, LOGGER)
    for rank, r in enumerate(reports):
        assert r["bound_is_wrapped"] is True  # SGLang binds the function at import: ours
        (d,) = r["decisions"]  # one vote; the second op call never asks again
        assert d["outcome"] == "veto" and d["ranks"] == [0, 1] and d["backend"] == "trtllm"
        assert d["probe"] == "no" if rank == 1 else d["probe"] in ("ok", "-")  # "-": arrived after the no, followed it
        assert r["op_first"] == {"returned": [None, None]}  # the caller's non-fused path
        assert r["op_second"] == {"returned": [None, None]}
        assert r["unavailable"] is True and r["manager_initialized"] is False
        assert r["can_use"] is False
        warnings = messages(r, LOGGER)
        assert any("Disabling flashinfer allreduce fusion permanently" in m for m in warnings)
        if mode == "none":  # _configure_workspace_size_check() on None
            assert any("'NoneType' object has no attribute 'is_buffer_size_sufficient'" in m
                       for m in warnings)
        else:
            assert any("not created on any of ranks" in m for m in warnings)
        check_doc("SGLang", "0.5.23", mode, "non-fused")


def test_sglang_0523_own_preflight_vetoes_first(s0523):
    """With 16 MiB free on rank 1 SGLang's own preflight says no on every rank and the
    wrapped function is never called: no decision, no vote of ours."""
    reports = run_ranks("sglang", "0.5.23", s0523, [80 * 1024, 16], modes=("raise",))["raise"]
    for r in reports:
        assert r["decisions"] == []
        assert r["op_first"] == {"returned": [None, None]}
        assert r["unavailable"] is True
        assert any("cuMemCreate probe failed on at least one rank" in m
                   for m in messages(r, LOGGER))


@pytest.fixture(scope="module")
def s0510():
    return engine_root("sglang", "0.5.10.post1")


@pytest.mark.parametrize("mode", MODES)
def test_sglang_0510_none_crashes_in_forward_raise_falls_back(s0510, mode):
    reports = run_ranks("sglang", "0.5.10.post1", s0510, [80 * 1024, 16])[mode]
    check_answers(reports, mode, LOGGER)
    for rank, r in enumerate(reports):
        (d,) = r["decisions"]  # the retry on the next call is served by the veto cache
        assert d["outcome"] == "veto" and (d["probe"] == "no" if rank == 1 else d["probe"] in ("ok", "-"))
        if mode == "none":
            # None is stored as an initialized workspace and handed to allreduce_fusion
            assert r["manager_initialized"] is True and r["manager_workspace"] == "None"
            assert r["unavailable"] is False
            for call in ("op_first", "op_second"):
                err = r[call]["raised"]
                assert err["where"] == "allreduce.py"  # inside FlashInfer's kernel entry
                assert "NoneType" in err["message"]
            observed = f"crash: {r['op_first']['raised']['type']} in forward"
        else:
            assert r["op_first"] == {"returned": [None, None]}
            assert r["op_second"] == {"returned": [None, None]}
            assert r["unavailable"] is True and r["manager_initialized"] is False
            assert any("not created on any of ranks" in m for m in messages(r, LOGGER))
            observed = "non-fused"
        check_doc("SGLang", "0.5.10.post1", mode, observed)


# SGLang 0.5.14-0.5.19: the runner's warm-up creates the workspace, then one decoder
# layer's norm runs as the communicator runs it. Rank 1 has 3000 MiB free and the shim
# keeps 4 GiB of headroom: SGLang's own preflight passes, the shim vetoes.
MODERN = ["0.5.14", "0.5.17", "0.5.19"]


@pytest.mark.parametrize("version", MODERN)
@pytest.mark.parametrize("mode", MODES)
def test_sglang_014_019_layer_output_against_the_non_fused_reference(version, mode):
    root = engine_root("sglang", version)
    reports = run_ranks("sglang", version, root, [80 * 1024, 3000],
                        FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB="4096")[mode]
    check_answers(reports, mode, LOGGER)
    observed = set()
    for rank, r in enumerate(reports):
        assert r["bound_is_wrapped"] is True
        assert r["real_files"] == sorted(
            ["sglang/srt/environ.py", "sglang/srt/layers/flashinfer_comm_fusion.py",
             "sglang/srt/layers/layernorm.py"])
        (d,) = r["decisions"]  # repeats, if any, are answered by the veto cache
        assert d["outcome"] == "veto" and d["ranks"] == [0, 1] and d["backend"] == "trtllm"
        assert d["probe"] == "no" if rank == 1 else d["probe"] in ("ok", "-")  # "-": arrived after the no, followed it
        (a, b) = r["layers"]
        if version == "0.5.14" and mode == "none":
            # None stored with initialized=True; the communicator keeps deferring the
            # all-reduce to the fused norm, which returns (None, None); the layer then
            # normalises the rank's partial sum: the all-reduce is silently dropped
            assert r["manager_initialized"] is True and r["manager_workspace"] == "None"
            assert r["unavailable_after"] is False
            for layer in (a, b):
                assert layer["deferred_to_fused_norm"] is True
                assert layer["matches_reference"] is False and layer["matches_unreduced"] is True
                assert layer["max_abs_diff"] > 0.1
            # and it asks again on every call: warm-up (2 managers) + 2 layer calls
            assert len(r["answers"]) == 4
            observed.add("wrong output")
        else:
            # an exception (or, from 0.5.17, None failing SGLang's own size check) sets
            # _flashinfer_allreduce_unavailable: the layer all-reduces, then normalises
            assert r["unavailable"] is True and r["manager_initialized"] is False
            for layer in (a, b):
                assert layer["deferred_to_fused_norm"] is False
                assert layer["matches_reference"] is True and layer["max_abs_diff"] == 0.0
            assert any("Disabling flashinfer allreduce fusion permanently" in m
                       for m in messages(r, LOGGER))
            observed.add("non-fused")
    (outcome,) = observed  # the same on every rank
    check_doc("SGLang", version, mode, outcome)


@pytest.mark.parametrize("version", MODERN)
def test_sglang_communicator_defers_only_while_fusion_is_available(version):
    """The communicator's gate (``apply_flashinfer_allreduce_fusion``) has
    ``not is_flashinfer_allreduce_unavailable()``: what the layer drive mirrors."""
    from _engines import SGL_COMM, gate_requires_not

    root = engine_root("sglang", version)
    assert gate_requires_not(root / SGL_COMM, "apply_flashinfer_allreduce_fusion",
                             "is_flashinfer_allreduce_unavailable")


@pytest.mark.parametrize("mode", MODES)
def test_sglang_058_legacy_op_raises_on_every_rank(mode):
    """SGLang 0.5.8 tuple-unpacks the legacy function lazily, in the first fused norm of
    the forward, with no ``try``: ``WorkspaceVetoed`` on every rank in every mode (the
    legacy entry always raises), on each call (the veto cache answers the repeat)."""
    root = engine_root("sglang", "0.5.8")
    reports = run_ranks("sglang", "0.5.8", root, [80 * 1024, 16])[mode]
    check_answers(reports, mode, LOGGER, legacy=True)
    for rank, r in enumerate(reports):
        (d,) = r["decisions"]
        assert d["entry"] == "legacy" and d["ranks"] == [0, 1]
        assert d["probe"] == "no" if rank == 1 else d["probe"] in ("ok", "-")  # "-": arrived after the no, followed it
        for call in ("op_first", "op_second"):
            err = r[call]["raised"]
            assert err["type"] == "WorkspaceVetoed" and "not created on any of ranks" in err["message"]
        assert r["manager_initialized"] is False
    check_doc("SGLang", "0.5.8", mode, "crash in forward: WorkspaceVetoed on every rank")
