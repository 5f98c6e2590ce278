"""vLLM's real workspace-creation code (from its released wheels) under the shim's veto.

Two ranks over real gloo groups; rank 1's simulated GPU has 16 MiB free, so its
probe (plan + 512 MiB headroom) fails and the vote vetoes on both ranks. What vLLM
then does is its own code: ``vllm/distributed/device_communicators/flashinfer_all_reduce.py``
of each release, fetched at test time (see ``_wheels.py``; stand-ins in
``engine_rank.py``, each with its reason). FlashInfer is the installed release,
not the one vLLM pins (0.33.0 pins 0.7.2.post1): the veto happens before FlashInfer
runs, so FlashInfer's allocation code is not exercised here.
"""

from __future__ import annotations

import pytest

from _engines import VLLM_PASS, guarded_by_except_exception, none_check_disables
from _runner import MODES, check_answers, check_doc, engine_root, messages, run_ranks

FREE = [80 * 1024, 16]  # MiB per rank: rank 1 is short of any plan plus any headroom
LOGGER = "vllm.distributed.device_communicators.flashinfer_all_reduce"


def _common(reports):
    for rank, r in enumerate(reports):
        assert r["real_files"][0].endswith(("flashinfer_all_reduce.py", "collective_fusion.py"))
        assert all(d["outcome"] == "veto" and d["ranks"] == [0, 1] for d in r["decisions"])
        # rank 1 (short) probes and says no, unless it came after the round was decided (a
        # slow start under load: "-", it followed without probing); rank 0 probes ("ok")
        # unless it came after rank 1's no had decided the round
        probes = [d["probe"] for d in r["decisions"]]
        allowed = ("ok", "-") if rank == 0 else ("no", "-")
        assert probes and all(p in allowed for p in probes), (rank, r["decisions"])
    assert "no" in [d["probe"] for d in reports[1]["decisions"]], reports[1]["decisions"]


@pytest.fixture(scope="module")
def v033():
    return engine_root("vllm", "0.33.0")


@pytest.mark.parametrize("mode", MODES)
def test_vllm_033_ends_non_fused(v033, mode):
    reports = run_ranks("vllm", "0.33.0", v033, FREE)[mode]
    _common(reports)
    check_answers(reports, mode, LOGGER)
    for r in reports:
        # backend auto on one node: mnnvl first, then the trtllm fallback; both vetoed
        assert [d["backend"] for d in r["decisions"]] == ["mnnvl", "trtllm"]
        assert r["workspace"] == "None" and r["failed_latch"] is True
        assert r["again"] == "None"  # latched: no third decision
        assert r["standalone_enabled_before"] and r["standalone_ensure"] is False
        assert r["standalone_disabled"] is True
        warnings = messages(r, LOGGER)
        errors = messages(r, LOGGER, "ERROR")
        assert any("Failed to initialize FlashInfer Allreduce norm fusion workspace "
                   "with backend=trtllm" in m for m in errors)
        # vLLM labels any error mentioning "multicast" as expected on GPUs without NVSwitch
        # (our veto message, which vLLM logs in raise/auto mode, must not say it)
        ours = [m for m in warnings + errors if "not created on any of ranks" in m]
        assert not any("multicast" in m.lower() for m in ours)
        if mode == "none":
            # mnnvl: None.destroy() -> AttributeError, caught and logged as a failure
            assert any("'NoneType' object has no attribute 'destroy'" in m for m in warnings)
            # trtllm None is registered under id(None) ...
            assert r["none_registered"] is True
            # ... so a workspace for another group over the same ranks crashes, uncaught
            err = r["quant_other_group_error"]
            assert err["type"] == "RuntimeError" and "different process group" in err["message"]
            observed = "non-fused, RuntimeError for a 2nd group"
        else:  # raise, and auto (a vllm. caller)
            assert any("not created on any of ranks" in m for m in warnings)
            assert r["none_registered"] is False
            assert r["quant_other_group"] == "None"
            observed = "non-fused"
        check_doc("vLLM", "0.33.0", mode, observed)


def test_vllm_033_fusion_pass_disables_itself_on_none(v033):
    """The pass itself needs vLLM's compiler stack; its reaction to ``None`` from the
    function driven above is read from its real source."""
    assert none_check_disables(v033 / VLLM_PASS, "AllReduceFusionPass", "__init__",
                               "get_fi_ar_workspace")


@pytest.mark.parametrize("version", ["0.17.0", "0.18.0"])
@pytest.mark.parametrize("mode", MODES)
def test_vllm_017_018_end_non_fused(version, mode):
    root = engine_root("vllm", version)
    reports = run_ranks("vllm", version, root, FREE)[mode]
    _common(reports)
    check_answers(reports, mode, LOGGER)
    for r in reports:
        assert len(r["decisions"]) == 1  # the standalone retry is served by the veto cache
        err = r["initialize_error"]
        if mode == "none":
            # `assert _fi_ar_workspace is not None` in initialize_fi_ar_workspace
            assert err["type"] == "AssertionError" and err["where"] == "flashinfer_all_reduce.py"
        else:
            assert err["type"] == "WorkspaceVetoed" and "not created on any of ranks" in err["message"]
        assert r["workspace"] == "None"
        assert r["standalone_ensure"] is False and r["standalone_disabled"] is True
        assert any("FlashInfer All Reduce will be disabled" in m
                   for m in messages(r, LOGGER))
        check_doc("vLLM", version, mode, "non-fused")


@pytest.mark.parametrize("version", ["0.17.0", "0.18.0"])
def test_vllm_017_018_fusion_pass_catches_creation_errors(version):
    root = engine_root("vllm", version)
    assert guarded_by_except_exception(root / VLLM_PASS, "AllReduceFusionPass", "__init__",
                                       "initialize_fi_ar_workspace")


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0"])
@pytest.mark.parametrize("mode", MODES)
def test_vllm_020_026_end_non_fused(version, mode):
    """No failure latch and no ``id(None)`` bookkeeping: ``None`` and an exception both
    become ``None`` from ``_create_workspace``; the repeats are served by the veto cache."""
    root = engine_root("vllm", version)
    reports = run_ranks("vllm", version, root, FREE)[mode]
    _common(reports)
    check_answers(reports, mode, LOGGER)
    # 0.20 picks trtllm on one node; 0.26 picks mnnvl and falls back to trtllm
    first = ["trtllm"] if version == "0.20.0" else ["mnnvl", "trtllm"]
    for r in reports:
        backends = [d["backend"] for d in r["decisions"]]
        # then the quant workspace (another size: another call, decided afresh the same way)
        assert backends == first + first
        assert r["workspace"] == "None" and r["again"] == "None"
        assert r["none_registered"] is False and r["quant_other_group"] == "None"
        assert r["standalone_enabled_before"] and r["standalone_ensure"] is False
        assert r["standalone_disabled"] is True
        assert any("Failed to initialize FlashInfer Allreduce norm fusion workspace "
                   "with backend=trtllm" in m for m in messages(r, LOGGER))
        check_doc("vLLM", version, mode, "non-fused")


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0"])
def test_vllm_020_026_fusion_pass_disables_itself_on_none(version):
    root = engine_root("vllm", version)
    assert none_check_disables(root / VLLM_PASS, "AllReduceFusionPass", "__init__",
                               "get_fi_ar_workspace")


@pytest.mark.parametrize("mode", MODES)
def test_vllm_015_legacy_pass_fails_start_up_on_every_rank(mode):
    """vLLM 0.15 tuple-unpacks the legacy function in ``AllReduceFusionPass.__init__``
    (first torch.compile, during start-up) with no ``try``: the legacy entry raises in
    every mode, so start-up fails with the shim's message on every rank, instead of one
    rank failing and the other hanging in the handle exchange."""
    root = engine_root("vllm", "0.15.0")
    reports = run_ranks("vllm", "0.15.0", root, FREE)[mode]
    _common(reports)
    check_answers(reports, mode, "vllm.compilation.collective_fusion", legacy=True)
    for r in reports:
        (d,) = r["decisions"]
        assert d["entry"] == "legacy" and d["backend"] == "trtllm"
        err = r["pass_error"]
        assert err["type"] == "WorkspaceVetoed" and "not created on any of ranks" in err["message"]
    check_doc("vLLM", "0.15.0", mode, "clean start-up failure on every rank")


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0", "0.33.0"])
def test_vllm_compile_cache_hazard_is_in_the_source(version):
    """What docs/engines.md says about the compile cache: the fused custom op asserts a
    workspace exists, and ``AllReduceFusionPass`` defines no ``uuid`` of its own, so its
    cache identity does not include whether it disabled itself."""
    from _engines import asserts_workspace, class_defines

    root = engine_root("vllm", version)
    assert asserts_workspace(root / VLLM_PASS)
    assert not class_defines(root / VLLM_PASS, "AllReduceFusionPass", "uuid")
