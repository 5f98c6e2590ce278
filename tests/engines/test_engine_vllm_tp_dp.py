"""Failure mode 1 (docs/failure-modes.md) on vLLM 0.22.0's real call site.

vLLM 0.22.0's ``_create_workspace`` (``flashinfer_all_reduce.py``, fetched from its
wheel at test time) calls ``create_allreduce_fusion_workspace(...,
comm_backend=TorchDistBackend(group=group))`` with no ``group=`` (read from the source
below). FlashInfer 0.6.10 to 0.6.14 build the trtllm workspace on torch symmetric memory
and rendezvous on ``group=``, WORLD when it is not passed: with DP > 1 each TP group
waits for ranks that never come (vLLM 0.22-0.23 hang at start-up; vllm#45917,
flashinfer#3247). vLLM 0.22.0 pins FlashInfer 0.6.11.post2; 0.26 adds ``group=group``.

Four gloo ranks, TP=2 x DP=2 (TP groups [0, 1] and [2, 3], as vLLM lays out DP outside
TP), every simulated GPU with 80 GiB free, so only the ``group`` check can say no. The
shim plans for the release in ``FIWS_ENGINE_PLAN_FLASHINFER`` (FlashInfer's
``__version__`` set in the rank, as tests/ranks/test_checks.py does); the installed FlashInfer
(0.7.4) is what runs if a call is let through, down to its workspace classes, which are
stand-ins (no GPU). Every wait is bounded: the vote by ``VOTE_TIMEOUT=60``, each rank
process by ``_runner.TIMEOUT``.
"""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R
from _engines import VLLM_FI, VLLM_PASS, call_keywords, none_check_disables
from _runner import MODES, check_answers, check_doc, engine_root, messages, run_ranks

VERSION = "0.22.0"
FREE = [80 * 1024] * 4  # MiB per rank: memory is no reason to say no
TP = 2
LOGGER = "vllm.distributed.device_communicators.flashinfer_all_reduce"
VOTE_TIMEOUT = 60  # _runner.run_ranks sets FLASHINFER_SAFE_WORKSPACE_VOTE_TIMEOUT=60


@pytest.fixture(scope="module")
def v022():
    return engine_root("vllm", VERSION)


def _run(root, plan_for, modes=MODES):
    return run_ranks("vllm", VERSION, root, FREE, modes=modes,
                     FIWS_ENGINE_PLAN_FLASHINFER=plan_for, FIWS_ENGINE_TP=str(TP))


def _layout(reports):
    assert [r["tp_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for r in reports:
        assert VLLM_FI in r["real_files"], r["real_files"]
        assert max(r["call_secs"]) < VOTE_TIMEOUT, r["call_secs"]  # nothing waited it out


def test_vllm_022_calls_without_group(v022):
    """The cause, in vLLM 0.22.0's own source: one call, a comm backend, no ``group=``."""
    (kws,) = call_keywords(v022 / VLLM_FI, "_create_workspace",
                           "create_allreduce_fusion_workspace")
    assert "comm_backend" in kws and "group" not in kws, kws


def test_vllm_022_fusion_pass_disables_itself_on_none(v022):
    assert none_check_disables(v022 / VLLM_PASS, "AllReduceFusionPass", "__init__",
                               "get_fi_ar_workspace")


def _vetoed_by_group(reports, release, mode):
    _layout(reports)
    check_answers(reports, mode, LOGGER)
    for r in reports:
        assert r["planned_for"] == release
        assert r["decisions"], r
        (shim,) = r["shim_warnings"]  # the veto WARNING, in every mode
        for d in r["decisions"]:
            assert d["outcome"] == "veto" and d["backend"] == "trtllm", d
            assert d["ranks"] == r["tp_ranks"] and d["check"] == "group", d
            # the code by name; a rank that arrived after its TP peer's no had decided
            # the round follows it (ABORTED), the peer's reasons reaching it as text
            assert d["reasons"] == ["RENDEZVOUS_GROUP"] or (
                d["reasons"] == ["ABORTED"] and "decided before this rank arrived" in shim), d
        assert f"ranks {r['tp_ranks']}: rank " in shim, shim
        assert "check group: " + R.REASON_TEXT[R.RENDEZVOUS_GROUP] in shim, shim
        assert "(rendezvous=WORLD size=4 world_size=2)" in shim, shim
        assert f"FlashInfer {release} rendezvouses on WORLD (4 ranks" in shim, shim
        # FlashInfer never entered, nothing allocated
        assert r["flashinfer_entries"] == 0 and r["workspaces_made"] == [], r
        # vLLM's non-fused path: the pass disables itself, the standalone all-reduce too
        assert r["workspace"] == "None" and r["pass_disabled"] is True
        assert r["standalone_enabled_before"] and r["standalone_ensure"] is False
        assert r["standalone_disabled"] is True
        warnings = messages(r, LOGGER)
        assert any("Failed to initialize FlashInfer Allreduce norm fusion workspace "
                   "with backend=trtllm" in m for m in warnings), warnings
        if mode != "none":  # vLLM logs the WorkspaceVetoed it caught: our message
            ours = [m for m in warnings if "not created on any of ranks" in m]
            assert ours and all("check group" in m and "WORLD" in m for m in ours), warnings
    for tp in ([0, 1], [2, 3]):  # each TP group's deciding rank carries the code itself
        assert any(d["reasons"] == ["RENDEZVOUS_GROUP"] for r in reports
                   if r["tp_ranks"] == tp for d in r["decisions"]), tp


@pytest.mark.parametrize("mode", MODES)
def test_vllm_022_tp2_dp2_on_0_6_10_ends_non_fused_on_every_rank(v022, mode):
    reports = _run(v022, "0.6.10")[mode]
    _vetoed_by_group(reports, "0.6.10", mode)
    check_doc("vLLM", VERSION, mode, "non-fused")


def test_vllm_022_tp2_dp2_on_its_pinned_0_6_11_post2_is_vetoed_the_same(v022):
    reports = _run(v022, "0.6.11.post2", modes=("auto",))["auto"]
    _vetoed_by_group(reports, "0.6.11.post2", "auto")


def test_vllm_022_tp2_dp2_on_0_7_4_creates(v022):
    """The contrast: FlashInfer 0.7.4 (the trtllm workspace is no longer torch symmetric
    memory) rendezvouses on the comm backend's group, so the same call site, on the same
    four ranks, is let through on every rank: FlashInfer entered once per rank (which
    also shows that the entry counter the vetoed runs read as 0 does count)."""
    reports = _run(v022, "0.7.4", modes=("auto",))["auto"]
    _layout(reports)
    for r in reports:
        assert r["planned_for"] == "0.7.4" and r["answers"] == []
        (d,) = r["decisions"]  # the quant workspace and the standalone reuse it
        assert d["outcome"] == "pass" and d["check"] == "-" and d["reasons"] == [], d
        assert d["ranks"] == r["tp_ranks"], d
        assert r["flashinfer_entries"] == 1 and r["workspaces_made"] == ["trtllm"], r
        assert r["workspace"] == r["quant"] == "<RecordedWorkspace backend=trtllm>"
        assert r["pass_disabled"] is False
        assert r["standalone_ensure"] is True and r["standalone_disabled"] is False
