"""``ON_VETO=auto``: the caller resolution (``_caller.resolve``) from real frames whose
modules carry engine names, and the engine table against the verified docs table."""

from __future__ import annotations

import statistics
import time

import pytest

from flashinfer_safe_workspace import _caller, _config

from _runner import doc_outcomes


def _call_from(module_chain, on_veto="auto", entry="unified"):
    """Call ``resolve`` through a chain of real frames, outermost first, each frame's
    function defined in a namespace whose ``__name__`` is the given module name."""
    inner = lambda: _caller.resolve(on_veto, entry)  # noqa: E731  (this test module)
    fn = inner
    for name in reversed(module_chain):
        ns = {"__name__": name, "nxt": fn}
        exec("def call():\n    return nxt()\n", ns)
        fn = ns["call"]
    return fn()


# the shape of a real call: engine -> flashinfer -> wrapt -> our wrapper -> resolve
WRAPPED = ["flashinfer.comm.allreduce", "wrapt.wrappers", "flashinfer_safe_workspace._wrapper"]


def _via_wrapper(engine_module, **kw):
    # the innermost frame (the lambda) is this test module: make it ours too
    return _call_from([engine_module] + WRAPPED, **kw)


@pytest.mark.parametrize("module,prefix", [
    ("sglang.srt.layers.flashinfer_comm_fusion", "sglang"),
    ("vllm.distributed.device_communicators.flashinfer_all_reduce", "vllm"),
    ("lmdeploy.pytorch.backends.cuda.comm.flashinfer_allreduce", "lmdeploy"),
    ("aphrodite.distributed.device_communicators.flashinfer_all_reduce", "aphrodite"),
    ("vllm", "vllm"),
])
def test_auto_raises_for_engine_callers(module, prefix, monkeypatch):
    monkeypatch.setattr(_caller, "_SKIP", _caller._SKIP + (__name__,))
    answer = _via_wrapper(module)
    assert answer.kind == "raise" and answer.caller == module
    assert answer.why.startswith(f"auto: {prefix} falls back on an exception")
    assert _caller.fields(answer) == f"answer=raise caller={module}"


@pytest.mark.parametrize("module", ["myserver.model", "vllmx.fork", "sglang_router.x",
                                    "__main__", "lightllm.common.flashinfer"])
def test_auto_gives_none_to_every_other_caller(module, monkeypatch):
    monkeypatch.setattr(_caller, "_SKIP", _caller._SKIP + (__name__,))
    answer = _via_wrapper(module)
    assert answer.kind == "none" and answer.caller == module


def test_the_nearest_outside_frame_decides(monkeypatch):
    """An engine calling a third-party helper that calls FlashInfer: the helper is the
    caller (the engine did not make this call)."""
    monkeypatch.setattr(_caller, "_SKIP", _caller._SKIP + (__name__,))
    answer = _call_from(["sglang.srt.model_executor", "somelib.helpers"] + WRAPPED)
    assert (answer.kind, answer.caller) == ("none", "somelib.helpers")


@pytest.mark.parametrize("on_veto,kind", [("none", "none"), ("raise", "raise")])
def test_none_and_raise_always_win(on_veto, kind, monkeypatch):
    monkeypatch.setattr(_caller, "_SKIP", _caller._SKIP + (__name__,))
    for module in ("sglang.srt.layers.flashinfer_comm_fusion", "myserver.model"):
        answer = _via_wrapper(module, on_veto=on_veto)
        assert answer.kind == kind and answer.caller == module
        assert answer.why == f"ON_VETO={on_veto}"


@pytest.mark.parametrize("on_veto", _caller.CHOICES)
def test_the_legacy_entry_always_raises(on_veto):
    answer = _call_from(["myserver.model"], on_veto=on_veto, entry="legacy")
    assert answer.kind == "raise" and answer.why == "legacy entry always raises"


def test_unnamed_frames_and_errors_never_raise(monkeypatch):
    ns = {"nxt": lambda: _caller.resolve("auto", "unified")}  # no __name__ in globals
    exec("def call():\n    return nxt()\n", ns)
    monkeypatch.setattr(_caller, "_SKIP", _caller._SKIP + (__name__,))
    assert ns["call"]().caller == "-"

    def broken(depth=1):
        raise RuntimeError("boom")

    monkeypatch.setattr(_caller, "caller_module", broken)
    answer = _caller.resolve("auto", "unified")
    assert answer.kind == "raise" and answer.caller == "-" and "RuntimeError" in answer.why


def test_resolution_is_cheap():
    """A frame walk: well under a millisecond (no source files read, nothing imported)."""
    times = []
    for _ in range(200):
        t = time.perf_counter()
        _via_wrapper("sglang.srt.layers.flashinfer_comm_fusion")
        times.append(time.perf_counter() - t)
    assert statistics.median(times) < 1e-3


def test_auto_is_the_default_and_parses():
    assert _config.Settings().on_veto == "auto"
    assert _config.read_settings({}).on_veto == "auto"
    assert _config.read_settings({"FLASHINFER_SAFE_WORKSPACE_ON_VETO": "AUTO"}).on_veto == "auto"
    assert _config.BY_NAME["FLASHINFER_SAFE_WORKSPACE_ON_VETO"].default == "auto"


NAMESPACE = {"vLLM": "vllm", "SGLang": "sglang", "lmdeploy": "lmdeploy",
             "aphrodite-engine": "aphrodite"}


def test_engine_table_covers_every_verified_row():
    """Every engine in the verified docs table is in ``ENGINES`` with each verified
    release named among those that justify it, and ``auto`` reaches the non-fused path,
    or a clean failure on every rank where the release has no fallback, in every row."""
    rows = doc_outcomes()
    assert len(rows) >= 12
    for (engine, release), outcomes in rows.items():
        entry = _caller.engine_of(NAMESPACE[engine] + ".x")
        assert entry is not None and entry.prefix == NAMESPACE[engine], engine
        assert release in entry.releases.split(", "), (engine, release)
        assert outcomes["auto"] in ("non-fused", "clean start-up failure on every rank",
                                    "crash in forward: WorkspaceVetoed on every rank"), (
            engine, release, outcomes)


def test_doctor_lines_show_the_table():
    lines = _caller.doctor_lines("auto")
    assert "ON_VETO=auto" in lines[0]
    for e in _caller.ENGINES:
        assert any(line.strip().startswith(e.prefix + ".") for line in lines[1:])
    assert "every caller" in _caller.doctor_lines("raise")[0]
