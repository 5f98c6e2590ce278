"""``_caller``: what a vetoed caller gets. The calling module is read from real frames:
each test runs the lookup from code compiled under a chosen module name (an engine's, a
plain script's, FlashInfer's, this package's), with no engine imported."""

from __future__ import annotations

import functools

import pytest

from flashinfer_safe_workspace import _caller as C


@pytest.fixture(autouse=True)
def _past_mutmut(monkeypatch):
    """Under mutation testing (scripts/mutation) every call of ``_caller`` passes through
    mutmut's trampolines, frames of ``mutmut.*``: looked past like this package's own."""
    monkeypatch.setattr(C, "_SKIP", C._SKIP + ("mutmut",))
    monkeypatch.setattr(C, "_skipped", {})
    monkeypatch.setattr(C, "_engines_of", {})  # every test looks its engines up afresh


def hop_of(module: str):
    """A function ``hop(fn) -> fn()`` whose frame belongs to ``module``."""
    ns = {"__name__": module}
    exec(compile("def hop(fn):\n    return fn()\n", f"<{module!s}>", "exec"), ns)
    return ns["hop"]


def call_from(module: str, via: tuple = ("flashinfer_safe_workspace._wrapper",), **kw):
    """``C.resolve(**kw)`` as the wrapper calls it: from a frame of ``_decide``, below frames
    of ``via`` (outermost first), below a frame of ``module`` (``partial`` adds no frame)."""
    fn = functools.partial(hop_of("flashinfer_safe_workspace._decide"),
                           functools.partial(C.resolve, **kw))
    for name in reversed(via):
        fn = functools.partial(hop_of(name), fn)
    return hop_of(module)(fn)


ROWS = [  # (caller module, ON_VETO, entry) -> (kind, caller)
    ("vllm.distributed.x", C.AUTO, "unified", C.RAISE, "vllm.distributed.x"),
    ("vllm", C.AUTO, "unified", C.RAISE, "vllm"),
    ("sglang.srt.layers", C.AUTO, "unified", C.RAISE, "sglang.srt.layers"),
    ("lmdeploy.pytorch", C.AUTO, "unified", C.RAISE, "lmdeploy.pytorch"),
    ("aphrodite.x", C.AUTO, "unified", C.RAISE, "aphrodite.x"),
    ("vllmx.thing", C.AUTO, "unified", C.NONE, "vllmx.thing"),  # a prefix, not a namespace
    ("my_script", C.AUTO, "unified", C.NONE, "my_script"),
    ("my_script", C.RAISE, "unified", C.RAISE, "my_script"),
    ("vllm.x", C.NONE, "unified", C.NONE, "vllm.x"),
    ("my_script", C.NONE, "legacy", C.RAISE, "my_script"),  # the legacy entry always raises
    ("my_script", C.AUTO, "legacy", C.RAISE, "my_script"),
]


@pytest.mark.parametrize("module,on_veto,entry,kind,caller", ROWS)
def test_answer_per_caller_and_setting(module, on_veto, entry, kind, caller):
    a = call_from(module, on_veto=on_veto, entry=entry)
    assert (a.kind, a.caller) == (kind, caller)


def test_whys():
    assert call_from("m", on_veto=C.RAISE, entry="unified").why == "ON_VETO=raise"
    assert call_from("m", on_veto=C.NONE, entry="unified").why == "ON_VETO=none"
    assert call_from("m", on_veto=C.NONE, entry="legacy").why == "legacy entry always raises"
    assert call_from("m", on_veto=C.AUTO, entry="unified").why == (
        "auto: not a known engine, None as the design asks")
    why = call_from("sglang.srt", on_veto=C.AUTO, entry="unified").why
    assert why == ("auto: sglang falls back on an exception (SGLang 0.5.14-0.5.16 drop an "
                   "all-reduce on None)")


def test_flashinfer_and_wrapt_frames_are_looked_past():
    via = ("flashinfer.comm.x", "wrapt.wrappers", "flashinfer_safe_workspace._decide")
    a = call_from("sglang.srt.x", via=via, on_veto=C.AUTO, entry="unified")
    assert (a.kind, a.caller) == (C.RAISE, "sglang.srt.x")
    # a module merely named like them is not looked past
    a = call_from("vllm.x", via=("flashinfer_extra",), on_veto=C.AUTO, entry="unified")
    assert a.caller == "flashinfer_extra" and a.kind == C.NONE


def test_no_caller_lookup_unless_needed():
    a = call_from("vllm.x", on_veto=C.RAISE, entry="unified", need_caller=False)
    assert (a.kind, a.caller) == (C.RAISE, "-")
    a = call_from("vllm.x", on_veto=C.NONE, entry="legacy", need_caller=False)
    assert (a.kind, a.caller) == (C.RAISE, "-")
    a = call_from("vllm.x", on_veto=C.AUTO, entry="unified", need_caller=False)
    assert (a.kind, a.caller) == (C.RAISE, "vllm.x")  # auto always needs it


def test_a_nameless_frame_ends_the_walk():
    assert call_from("", on_veto=C.AUTO, entry="unified").caller == "-"
    a = hop_of(5)(functools.partial(hop_of("flashinfer_safe_workspace._decide"),
                                    functools.partial(C.resolve, C.AUTO, "unified")))
    assert (a.kind, a.caller) == (C.NONE, "-")


def test_the_top_of_the_stack_is_no_caller():
    assert C.caller_module(10 ** 6) == "-"


def test_resolve_never_raises(monkeypatch):
    def broken(depth=1):
        raise RuntimeError("frames")

    monkeypatch.setattr(C, "caller_module", broken)
    a = C.resolve(C.AUTO, "unified")
    assert a == C.Answer(C.RAISE, "-", "caller resolution failed (RuntimeError); raise")


def test_engine_of_and_fields():
    assert C.engine_of("vllm.a").name == "vLLM"
    assert C.engine_of("sglang").name == "SGLang"
    assert C.engine_of("vllm_x") is None and C.engine_of("x.vllm") is None
    assert C.engine_of("vllm_x") is None  # cached answer, the same
    assert C.engine_of("vllm.a").name == "vLLM"  # cached answer, the same
    assert C.engine_of("lmdeploy.x").name == "lmdeploy" and C.engine_of("aphrodite").prefix == "aphrodite"
    assert [e.prefix for e in C.ENGINES] == ["vllm", "sglang", "lmdeploy", "aphrodite"]
    assert C.fields(C.Answer(C.RAISE, "vllm.x", "w")) == "answer=raise caller=vllm.x"
    assert C.CHOICES == ("auto", "none", "raise")


def test_doctor_lines():
    auto = C.doctor_lines()
    assert auto[0] == ("on veto (ON_VETO=auto): WorkspaceVetoed for callers in vllm., sglang., "
                       "lmdeploy., aphrodite.; None for every other caller; the legacy entry raises")
    assert len(auto) == 1 + len(C.ENGINES)
    assert auto[1].startswith("  vllm.       vLLM (verified: 0.15.0")
    assert " -> auto answers raise; on None: " in auto[1] and "; on an exception: " in auto[1]
    assert C.doctor_lines(C.RAISE)[0] == "on veto: WorkspaceVetoed for every caller (ON_VETO=raise)"
    assert C.doctor_lines(C.NONE)[0] == (
        "on veto: None for every caller (ON_VETO=none); the legacy entry raises")
    assert C.doctor_lines(C.NONE)[1:] == auto[1:]
