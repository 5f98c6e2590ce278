"""The wrapper changes nothing FlashInfer does: same result object, same exceptions,
arguments it rejects pass straight through (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flashinfer.comm as comm
import flashinfer.comm.allreduce as ar
import flashinfer_safe_workspace as fiws
from flashinfer_safe_workspace import _log
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

NO_CUDA = "Torch not compiled with CUDA enabled"


@pytest.fixture
def shim():
    _probe.set_prober(SimulatedDevice(80 << 30))
    fiws.install()
    yield
    fiws.uninstall()


def _outcome(fn, kwargs):
    try:
        return ("ok", fn(**kwargs))
    except BaseException as exc:  # noqa: BLE001
        return ("raise", type(exc), str(exc))


def test_result_object_is_returned_untouched(shim, monkeypatch):
    made = []

    class Recording:
        def __init__(self, **kw):
            made.append(self)

    monkeypatch.setattr(ar, "TRTLLMAllReduceFusionWorkspace", Recording)
    ws = comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=1, rank=0,
                                                max_token_num=16, hidden_dim=64, dtype=torch.float16)
    assert made and ws is made[0]


def test_flashinfer_exception_is_untouched(shim, monkeypatch):
    boom = ValueError("FlashInfer says no")

    class Raising:
        def __init__(self, **kw):
            raise boom

    monkeypatch.setattr(ar, "TRTLLMAllReduceFusionWorkspace", Raising)
    with pytest.raises(ValueError) as info:
        comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=1, rank=0,
                                               max_token_num=16, hidden_dim=64, dtype=torch.float16)
    assert info.value is boom


def test_veto_in_raise_mode_is_a_runtime_error_without_multicast(monkeypatch):
    _probe.set_prober(SimulatedDevice(1 << 20))  # 1 MiB free: nothing fits
    fiws.install(on_veto="raise")
    with pytest.raises(fiws.WorkspaceVetoed) as info:
        comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=1, rank=0,
                                               max_token_num=16, hidden_dim=64, dtype=torch.float16)
    assert isinstance(info.value, RuntimeError)
    assert "multicast" not in str(info.value).lower()
    assert "OUT_OF_MEMORY" in str(info.value)


def test_legacy_api_always_raises_on_veto():
    _probe.set_prober(SimulatedDevice(1 << 20))
    fiws.install(on_veto="none")
    with pytest.raises(fiws.WorkspaceVetoed):
        comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            tp_rank=0, tp_size=1, max_token_num=16, hidden_dim=64)


VALUES = st.one_of(st.none(), st.integers(-3, 20000), st.sampled_from(["2", 2.5, True, 455]))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(["trtllm", "mnnvl", "auto", "mnnvl-cutedsl", "bogus", "", "TRTLLM"]),
       world_size=VALUES, rank=VALUES, max_token_num=VALUES, hidden_dim=VALUES,
       dtype=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32, torch.int8]),
       force=st.booleans(), top_k=st.sampled_from([None, 10]))
def test_rejected_arguments_pass_through_unchanged(shim, backend, world_size, rank, max_token_num,
                                                   hidden_dim, dtype, force, top_k):
    kwargs = dict(backend=backend, world_size=world_size, rank=rank, max_token_num=max_token_num,
                  hidden_dim=hidden_dim, dtype=dtype, force_oneshot_support=force)
    if top_k is not None:
        kwargs["top_k"] = top_k
    fiws.uninstall()  # FlashInfer alone (its unified API calls the legacy binding internally)
    try:
        plain = _outcome(comm.create_allreduce_fusion_workspace, kwargs)
    finally:
        fiws.install()
    lines = _Lines()
    with lines:
        wrapped = _outcome(comm.create_allreduce_fusion_workspace, kwargs)
    if plain[0] == "raise" and NO_CUDA in plain[2]:
        # FlashInfer accepts the arguments and reaches CUDA (absent here). With the shim it
        # either runs the same way after a yes (the same error, a "pass" line), or is
        # vetoed for a stated reason (None, a "veto" line with its reason codes).
        decided = _log.parse_decision_lines("\n".join(lines.messages))
        if wrapped == plain:
            assert [d["outcome"] for d in decided] in ([], ["pass"]), decided
        else:
            assert wrapped == ("ok", None), (wrapped, plain)
            assert [d["outcome"] for d in decided] == ["veto"] and decided[0]["reasons"], decided
    else:
        assert wrapped == plain


class _Lines:
    """This test's log lines of the shim (a handler for the duration of one call)."""

    def __init__(self):
        import logging

        self.messages = []
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.logger = logging.getLogger("flashinfer_safe_workspace")

    def __enter__(self):
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel("INFO")

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def test_mnnvl_plan_uses_the_multicast_granularity_of_the_object_size(monkeypatch, caplog):
    caplog.set_level("INFO", logger="flashinfer_safe_workspace")
    """FlashInfer asks for the multicast granularity of the exact object it creates; the
    answer depends on the size. The plan (and so the probe) must use the same answer."""
    from flashinfer_safe_workspace import _decide

    asked = []

    def granularity(size):
        asked.append(size)
        return (512 << 20) if size >= (64 << 20) else (2 << 20)

    dev = SimulatedDevice(80 << 30, mc_granularity=granularity)
    _probe.set_prober(dev)
    fiws.install()
    monkeypatch.setattr(ar, "MNNVLAllReduceFusionWorkspace", lambda **kw: "made")
    monkeypatch.setattr(ar, "Mapping", lambda **kw: None)
    comm.create_allreduce_fusion_workspace(backend="mnnvl", world_size=1, rank=0, max_token_num=2048,
                                           hidden_dim=4096, dtype=torch.bfloat16)
    # ws=1, T=2048, H=4096, bf16: buf = two-shot 32 MiB; 3*buf + 2048 B pad rounded to 2 MiB
    assert asked == [98 << 20]
    # ... then rounded to the 512 MiB the driver gives for that size, plus a few small tails
    (line,) = _log.parse_decision_lines(caplog.text)
    assert (512 << 20) <= line["plan_bytes"] < (512 << 20) + 1024


def test_no_process_group_passes_flashinfers_own_error_through():
    """Found by the property above: without torch.distributed, a multi-rank trtllm workspace
    fails inside FlashInfer before allocating; the caller must see that error, not a veto."""
    _probe.set_prober(SimulatedDevice(1 << 20))  # would veto if it were asked
    fiws.install(on_veto="raise")
    with pytest.raises(RuntimeError) as info:
        comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=455, rank=0,
                                               max_token_num=6225, hidden_dim=6966,
                                               dtype=torch.float32)
    assert not isinstance(info.value, fiws.WorkspaceVetoed)
    assert "torch.distributed is not initialized" in str(info.value)


def test_graph_capture_consults_the_veto_cache_first(monkeypatch):
    """SGLang 0.5.14-0.5.16 retry creation inside CUDA graph capture after a veto, with a
    fresh comm_backend object each time: the retry must get the cached veto (keyed by the
    workspace, not by the call's objects), not reach FlashInfer unprotected."""
    from flashinfer.comm.mnnvl import CommBackend

    class Solo(CommBackend):  # a fresh object per attempt, as the engines build them
        def Get_rank(self): return 0
        def Get_size(self): return 1
        def allgather(self, data): return [data]
        def bcast(self, data, root=0): return data
        def barrier(self): pass
        def Split(self, color, key): return self

    entered = []
    monkeypatch.setattr(ar, "TRTLLMAllReduceFusionWorkspace",
                        lambda **kw: entered.append(kw) or "made")
    _probe.set_prober(SimulatedDevice(1 << 20))  # 1 MiB: every plan is vetoed
    fiws.install(on_veto="none")
    args = dict(backend="trtllm", world_size=1, rank=0, max_token_num=512, hidden_dim=1024,
                dtype=torch.bfloat16)
    assert comm.create_allreduce_fusion_workspace(comm_backend=Solo(), **args) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert comm.create_allreduce_fusion_workspace(comm_backend=Solo(), **args) is None
    assert entered == []  # FlashInfer never entered, during capture either
    # an undecided call during capture is vetoed (the capture check), FlashInfer not entered
    assert comm.create_allreduce_fusion_workspace(comm_backend=Solo(), **dict(args, hidden_dim=2048)) is None
    assert entered == []


@pytest.mark.parametrize("where", [
    pytest.param("decide", marks=pytest.mark.internal_errors("decide")),
    pytest.param("group", marks=pytest.mark.internal_errors("group"))])
def test_a_veto_this_rank_decides_alone_logs_its_line_and_warning(monkeypatch, caplog, where):
    """A veto decided on this rank alone (our own failure: an internal error in the
    decision, or no rank set) logs the decision line and the veto WARNING like any veto,
    with the sentence that says this rank vetoed on its own, and the page to read."""
    import logging

    from flashinfer_safe_workspace import _decide
    from flashinfer_safe_workspace.agreement import group as _group

    def boom(*a, **k):
        raise RuntimeError("injected")

    if where == "decide":
        monkeypatch.setattr(_decide, "decide", boom)
    else:
        monkeypatch.setattr(_group, "members_for", boom)
    _probe.set_prober(SimulatedDevice(80 << 30))
    fiws.install(on_veto="none")
    try:
        with caplog.at_level(logging.INFO, logger="flashinfer_safe_workspace"):
            out = comm.create_allreduce_fusion_workspace(
                backend="trtllm", world_size=1, rank=0, max_token_num=16, hidden_dim=64,
                dtype=torch.float16)
    finally:
        fiws.uninstall()
    assert out is None
    lines = _log.parse_decision_lines(caplog.text)
    assert [d["outcome"] for d in lines] == ["veto"]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING
                  and getattr(r, "fiws_event", "") == "veto"]
    text = warning.getMessage()
    assert "this rank vetoed the call on its own" in text and "injected" in text
    assert text.endswith("What to do: docs/when-it-vetoes.md")
