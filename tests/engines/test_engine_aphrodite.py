"""aphrodite-engine (a vLLM fork, its own ``aphrodite.`` namespace and numbering): the
real ``aphrodite/distributed/device_communicators/flashinfer_all_reduce.py`` of its
released wheel under the shim's veto. Same drive as vLLM >= 0.20 (``engine_rank.py``)."""

from __future__ import annotations

import pytest

from _engines import APH_PASS, none_check_disables
from _runner import MODES, check_answers, check_doc, engine_root, messages, run_ranks

LOGGER = "aphrodite.distributed.device_communicators.flashinfer_all_reduce"


@pytest.mark.parametrize("mode", MODES)
def test_aphrodite_0241(mode):
    root = engine_root("aphrodite-engine", "0.24.1")
    reports = run_ranks("aphrodite-engine", "0.24.1", root, [80 * 1024, 16])[mode]
    check_answers(reports, mode, LOGGER)
    for rank, r in enumerate(reports):
        assert all(d["outcome"] == "veto" and d["ranks"] == [0, 1] for d in r["decisions"])
        # auto on one node: mnnvl, then trtllm; no failure latch (the repeats and the
        # standalone path are answered by the veto cache)
        assert [d["backend"] for d in r["decisions"]][:2] == ["mnnvl", "trtllm"]
        assert r["workspace"] == "None" and r["again"] == "None"
        assert r["standalone_ensure"] is False and r["standalone_disabled"] is True
        warnings = messages(r, LOGGER)
        if mode == "none":
            assert any("'NoneType' object has no attribute 'destroy'" in m for m in warnings)
            assert r["none_registered"] is True
            err = r["quant_other_group_error"]
            assert err["type"] == "RuntimeError" and "different process group" in err["message"]
            observed = "non-fused, RuntimeError for a 2nd group"
        else:
            assert any("not created on any of ranks" in m for m in warnings)
            assert r["none_registered"] is False and r["quant_other_group"] == "None"
            observed = "non-fused"
        check_doc("aphrodite-engine", "0.24.1", mode, observed)


def test_aphrodite_fusion_pass_disables_itself_on_none():
    root = engine_root("aphrodite-engine", "0.24.1")
    assert none_check_disables(root / APH_PASS, "AllReduceFusionPass", "__init__",
                               "get_fi_ar_workspace")
