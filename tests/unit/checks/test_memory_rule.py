"""Mode 12: the memory check's candidates. The plan for the release and the probe behind
the probe interface (the simulated device: the one CPU stand-in); what the rank records
for each way of creating the workspace (``auto``: with and without multicast), and the
check's entry in the record."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace.agreement.record import NO, PASS_STATE, YES, Candidate, CheckResult
from flashinfer_safe_workspace.checks import memory
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.plan import MiB, Facts, PassThrough, Request
from flashinfer_safe_workspace.planning.rules import plan_for
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
from unit.facts import settings

REQ = Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16")
AUTO = Request("unified", "auto", 2, 0, 2048, 4096, "bfloat16")
GiB = 1 << 30


def device(free=80 * GiB, **kw):
    dev = SimulatedDevice(free, **kw)
    _probe.set_prober(dev)  # conftest puts the default back after each test
    return dev


def test_one_candidate_that_fits():
    dev = device()
    cands, first = memory.candidates(REQ, "0.7.4", Facts(), settings(), 64 * MiB, auto=False)
    plan = plan_for(REQ, Facts(), "0.7.4")
    assert list(cands) == ["-"] and first == plan
    c = cands["-"]
    assert (c.state, c.reason, c.note) == (YES, R.OK, "")
    assert (c.plan_digest, c.peak_bytes, c.headroom_bytes, c.backend) == (
        str(plan.digest()), plan.peak_bytes, 64 * MiB, "trtllm")
    assert (c.device, c.free_bytes, c.failed_bytes, c.cuda_error, c.cuda_error_name,
            c.failed_headroom) == (0, 80 * GiB, 0, 0, "", False)
    assert c.probe_ms >= 0 and dev.probes == 1 and dev.live_bytes == 0


def test_a_plan_that_does_not_fit_is_out_of_memory():
    plan = plan_for(REQ, Facts(), "0.7.4")
    device(free=plan.peak_bytes - 1)
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert (c.state, c.reason) == (NO, R.OUT_OF_MEMORY)
    assert c.note in {a.name for a in plan.probe_allocations}
    assert c.cuda_error == _probe.CUDA_ERROR_OUT_OF_MEMORY
    assert c.cuda_error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert c.free_bytes == plan.peak_bytes - 1 and c.failed_bytes > 0
    assert c.failed_headroom is False


def test_the_headroom_that_does_not_fit_is_named():
    plan = plan_for(REQ, Facts(), "0.7.4")
    device(free=plan.peak_bytes + 2 * MiB)
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 64 * MiB, auto=False)[0]["-"]
    assert (c.state, c.reason, c.note, c.failed_headroom, c.failed_bytes) == (
        NO, R.OUT_OF_MEMORY, "headroom", True, 64 * MiB)
    opened = memory.candidates(REQ, "0.7.4", Facts(), settings(fail_open=True), 64 * MiB,
                               auto=False)[0]["-"]
    assert (opened.state, opened.reason) == (NO, R.OUT_OF_MEMORY)  # FAIL_OPEN: not for memory


def test_auto_has_two_candidates_and_one_without_multicast():
    device()
    cands, first = memory.candidates(AUTO, "0.7.4", Facts(), settings(), 0, auto=True)
    assert list(cands) == ["nomc", "mc"]
    assert (cands["nomc"].backend, cands["mc"].backend) == ("trtllm", "mnnvl")
    assert first.backend == "trtllm"
    assert cands["nomc"].plan_digest != cands["mc"].plan_digest
    only = memory.candidates(AUTO, "0.7.4", Facts(multicast_supported=False), settings(), 0,
                             auto=True)[0]
    assert list(only) == ["nomc"]


def test_auto_candidate_that_fits_only_without_multicast():
    nomc = plan_for(AUTO, Facts(multicast_all_ranks=False), "0.7.4")
    mc = plan_for(AUTO, Facts(multicast_all_ranks=True), "0.7.4")
    assert nomc.peak_bytes != mc.peak_bytes
    device(free=min(nomc.peak_bytes, mc.peak_bytes))
    cands = memory.candidates(AUTO, "0.7.4", Facts(), settings(), 0, auto=True)[0]
    small = "nomc" if nomc.peak_bytes < mc.peak_bytes else "mc"
    big = "mc" if small == "nomc" else "nomc"
    assert (cands[small].state, cands[big].state) == (YES, NO)


def test_pass_through_is_flashinfers_own_error():
    device()
    req = Request("unified", "nccl", 2, 0, 16, 64, "bfloat16")
    plan = plan_for(req, Facts(), "0.7.4")
    assert isinstance(plan, PassThrough)
    cands, first = memory.candidates(req, "0.7.4", Facts(), settings(), 0, auto=False)
    assert first is None
    assert cands["-"] == Candidate(PASS_STATE, R.PASS_THROUGH, plan.reason[:300],
                                   plan_digest=plan.reason)


@pytest.mark.internal_errors("plan")
def test_unplanned_release_is_a_no():
    device()
    c = memory.candidates(REQ, "0.4.0", Facts(), settings(), 0, auto=False)[0]["-"]
    assert (c.state, c.reason) == (NO, R.UNPLANNED)
    assert "older than 0.5.0" in c.note
    opened = memory.candidates(REQ, "0.4.0", Facts(), settings(fail_open=True), 0, auto=False)
    assert (opened[0]["-"].state, opened[1]) == (YES, None)


@pytest.mark.internal_errors("plan")
def test_a_plan_bug_is_an_internal_error(monkeypatch):
    from flashinfer_safe_workspace.planning import request as _request

    def broken(req, facts, version):
        raise ZeroDivisionError("rule bug")

    monkeypatch.setattr(_request, "plan_for", broken)
    device()
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert (c.state, c.reason, c.note) == (NO, R.INTERNAL_ERROR, "ZeroDivisionError: rule bug")
    opened = memory.candidates(REQ, "0.7.4", Facts(), settings(fail_open=True), 0, auto=False)
    assert (opened[0]["-"].state, opened[0]["-"].reason) == (YES, R.INTERNAL_ERROR)


@pytest.mark.internal_errors("probe.unavailable")
def test_no_device_is_a_no(monkeypatch):
    class Gone:
        def probe(self, plan, headroom):
            raise _probe.ProbeUnavailable("no driver")

    monkeypatch.setattr(_probe, "get_prober", lambda: Gone())
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 5, auto=False)[0]["-"]
    plan = plan_for(REQ, Facts(), "0.7.4")
    assert (c.state, c.reason, c.note) == (NO, R.NO_DEVICE, "no driver")
    assert (c.plan_digest, c.peak_bytes, c.headroom_bytes, c.backend) == (
        str(plan.digest()), plan.peak_bytes, 5, "trtllm")
    opened = memory.candidates(REQ, "0.7.4", Facts(), settings(fail_open=True), 5, auto=False)
    assert (opened[0]["-"].state, opened[0]["-"].reason) == (YES, R.NO_DEVICE)


@pytest.mark.internal_errors("probe")
def test_a_probe_that_raises_is_a_probe_error():
    device(error=RuntimeError("driver surprise"))
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 64 * MiB, auto=False)[0]["-"]
    assert (c.state, c.reason, c.note) == (NO, R.PROBE_ERROR, "RuntimeError: driver surprise")
    assert c.peak_bytes > 0 and c.backend == "trtllm"
    opened = memory.candidates(REQ, "0.7.4", Facts(), settings(fail_open=True), 0, auto=False)
    assert (opened[0]["-"].state, opened[0]["-"].reason) == (YES, R.PROBE_ERROR)


@pytest.mark.internal_errors("audit.floor")
def test_an_audit_floor_that_fails_probes_the_plan(monkeypatch):
    from flashinfer_safe_workspace.audit import compare as _audit

    def broken(plan, ident):
        raise KeyError("floor")

    monkeypatch.setattr(_audit, "apply_floor", broken)
    device()
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert c.state == YES


def test_the_floor_of_an_earlier_audit_is_probed(monkeypatch):
    from flashinfer_safe_workspace.audit import compare as _audit

    plan = plan_for(REQ, Facts(), "0.7.4")
    seen = []

    def floor(p, ident):
        seen.append(ident)
        return PassThroughPlan(p)

    def PassThroughPlan(p):  # noqa: N802 - a plan a third larger than planned
        import dataclasses
        from flashinfer_safe_workspace.planning.plan import Allocation

        return dataclasses.replace(p, allocations=p.allocations + (
            Allocation("audit-observed", p.peak_bytes, "cuMemCreate", "posix"),))

    monkeypatch.setattr(_audit, "apply_floor", floor)
    device(free=plan.peak_bytes + MiB)
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert c.state == NO and c.note == "audit-observed"
    assert c.plan_digest == str(plan.digest())  # digested before the floor
    from flashinfer_safe_workspace.planning.request import identity
    assert seen == [identity(REQ)]


def test_result_of_the_candidates():
    ok = Candidate(YES, peak_bytes=10, headroom_bytes=2, free_bytes=30)
    bad1 = Candidate(NO, R.OUT_OF_MEMORY, "buf", peak_bytes=11, headroom_bytes=3, free_bytes=5)
    bad2 = Candidate(NO, R.PROBE_ERROR, "x", peak_bytes=12)
    assert memory.result({"a": ok}) == CheckResult(True, R.OK, "plan=10 headroom=2 free=30", "")
    assert memory.result({"a": ok, "b": bad1, "c": bad2}) == CheckResult(
        False, R.OUT_OF_MEMORY, "plan=11 headroom=3 free=5", "buf")
    assert memory.result({}) == CheckResult(True, R.OK, "")
    # a usable candidate carrying a reason (FlashInfer's own error, FAIL_OPEN): the check passes
    for usable in (Candidate(PASS_STATE, R.PASS_THROUGH, "why"), memory.no(True, R.UNPLANNED, "n")):
        assert memory.result({"-": usable}) == CheckResult(True, R.OK, "plan=0 headroom=0 free=-1", "")


def test_no_cuts_its_note():
    c = memory.no(False, R.UNPLANNED, "n" * 400, peak_bytes=3)
    assert (c.state, c.reason, len(c.note), c.peak_bytes) == (NO, R.UNPLANNED, 300, 3)
    assert memory.no(True, R.UNPLANNED).state == YES
    assert memory.no(True, R.UNPLANNED).note == ""


def test_what_the_probe_found_is_recorded(monkeypatch):
    from flashinfer_safe_workspace.planning.probe import FailedAllocation, ProbeResult

    class Fixed:  # a prober answering one fixed result
        def probe(self, plan, headroom):
            return ProbeResult(False, device=3, free_bytes=7, total_bytes=9, elapsed_s=0.0123456,
                               failed=FailedAllocation("trtllm.buffer", 5, 999, "CUDA_ERROR_X"))

    monkeypatch.setattr(_probe, "get_prober", lambda: Fixed())
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert (c.state, c.reason, c.note, c.device, c.free_bytes, c.failed_bytes) == (
        NO, R.PROBE_ERROR, "trtllm.buffer", 3, 7, 5)
    assert (c.cuda_error, c.cuda_error_name, c.failed_headroom, c.probe_ms) == (
        999, "CUDA_ERROR_X", False, 12.346)


def test_a_long_pass_through_reason_is_cut_in_the_note_only(monkeypatch):
    from flashinfer_safe_workspace.planning import request as _request

    monkeypatch.setattr(_request, "plan_for", lambda req, facts, version: PassThrough("r" * 400))
    c = memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)[0]["-"]
    assert (c.state, len(c.note), c.plan_digest) == (PASS_STATE, 300, "r" * 400)


def test_the_probe_fault_point_is_hit_just_before_the_probe(monkeypatch):
    """``_points``' ``probe`` point (fault scenarios stop or fail a rank there)."""
    from flashinfer_safe_workspace import _points

    dev = device()
    seen = []
    monkeypatch.setattr(_points, "_hook", None)  # restored after the test
    _points.install(lambda name: seen.append((name, dev.probes)))
    memory.candidates(REQ, "0.7.4", Facts(), settings(), 0, auto=False)
    assert seen == [("probe", 0)] and dev.probes == 1
