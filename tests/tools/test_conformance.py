"""Conformance: FlashInfer's real workspace-creation code asks for exactly our plan.

FlashInfer (whichever release is importable: the installed one in CI, or one release
per range via scripts/conformance-matrix) runs on the CPU against recording
stand-ins for the CUDA driver/runtime, torch symmetric memory and the collectives
(tests/conformance/standins.py says what is replaced and why). Every allocation it
asks for — size, API, handle type, held or released, in order — must equal the plan
that flashinfer_safe_workspace computes for ``flashinfer.__version__``.

Facts: the stand-in of torch's symmetric-memory allocator pads each block with the
installed torch's own ``get_signal_pad_size()``; the plan gets its pad through the
shim's lookup (``_facts.signal_pad``), so a wrong pad in the shim shows as a mismatch.

Set FIWS_CONFORMANCE_REPORT=<path> to append a JSON line per test with the counts
(scripts/conformance-matrix builds docs/fidelity.md from them).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import os
import time

import pytest

from conformance import runner, standins
from flashinfer_safe_workspace.planning import facts as _facts, rules
from flashinfer_safe_workspace.planning.plan import MiB, Plan

try:
    flashinfer = standins.import_flashinfer()
except Exception as exc:  # pragma: no cover - no flashinfer, or it cannot load on CPU
    pytest.skip(f"flashinfer not importable on this host: {exc!r}", allow_module_level=True)

VERSION = flashinfer.__version__
RANGE = rules.range_of(VERSION)


def _report(test: str, **data) -> None:
    path = os.environ.get("FIWS_CONFORMANCE_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"test": test, "version": VERSION, "range": RANGE, **data}) + "\n")


@pytest.fixture(scope="module")
def installed():
    """The stand-ins, installed once for the module; workspaces are kept until the end
    and destroyed while the stand-ins are still in place (their __del__ calls the
    driver), then every patch is undone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_CONFIDENTIAL_COMPUTE", "0")
        rec = standins.Recorder()
        standins.install(mp, rec)
        keep: list = []
        yield rec, keep
        keep.clear()
        gc.collect()
    runner.reset_confidential_compute_cache(flashinfer)  # env restored: forget our answers


@pytest.fixture
def recorder(installed):
    rec, keep = installed
    yield rec, keep
    os.environ["FLASHINFER_CONFIDENTIAL_COMPUTE"] = "0"


@pytest.mark.parametrize("entry_name", list(runner.ENTRIES))
def test_flashinfer_asks_for_the_plan(recorder, entry_name):
    rec, keep = recorder
    specs = runner.grid(entry_name)
    start = time.perf_counter()
    outcomes = [runner.run(flashinfer, rec, spec, keep) for spec in specs]
    elapsed = time.perf_counter() - start
    counts = runner.summarize(outcomes)
    bad = [o for o in outcomes if o.status == "mismatch"]
    _report(entry_name, cases=len(outcomes), counts=counts, seconds=round(elapsed, 2),
            failures=[f"{o.spec.label()}: {o.detail}" for o in bad[:5]])
    assert not bad, f"{len(bad)}/{len(outcomes)} cases differ from the plan, e.g.\n" + \
        "\n".join(f"{o.spec.label()}: {o.detail}" for o in bad[:8])
    # every entry must exercise real comparisons, except where FlashInfer rejects it all
    if not _all_rejected(entry_name):
        assert counts.get("match", 0) > 0, counts


def _all_rejected(entry_name: str) -> bool:
    r = int(RANGE[1:])
    entry = runner.ENTRIES[entry_name][0]
    return (entry_name in ("legacy-symm-no-metadata",  # ValueError (0.5.x: TypeError)
                           "mnnvl-cutedsl")  # see runner.ENTRIES
            or (entry_name == "mnnvl-cutedsl-accepted" and not _cutedsl_planned())
            or (r == 0 and (entry == "unified" or entry_name == "legacy-symm"))
            or (r >= 6 and entry_name == "mnnvl-cc"))  # mnnvl refuses CC from 0.6.16


def test_comparison_detects_a_wrong_plan(recorder, monkeypatch):
    """Negative control: one byte more in the plan must be reported as a mismatch."""
    rec, keep = recorder
    entry = "legacy" if RANGE == "R0" else "trtllm"
    spec = runner.Spec(entry, 2, 0, 2048, 4096, "bfloat16", "h200")
    assert runner.run(flashinfer, rec, spec, keep).status == "match"
    real_plan = rules.plan_for

    def off_by_one(req, facts, version):
        plan = real_plan(req, facts, version)
        first = dataclasses.replace(plan.allocations[0], bytes=plan.allocations[0].bytes + 1)
        return dataclasses.replace(plan, allocations=(first,) + plan.allocations[1:])

    monkeypatch.setattr(rules, "plan_for", off_by_one)
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "mismatch" and "differ" in outcome.detail


# E1/E2 of the reference (§5) on H200 granularities, for docs/fidelity.md.
EXAMPLES = {
    "E1": (2, 2048, 4096, "bfloat16"),
    "E2": (8, 2048, 12288, "bfloat16"),
}


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("entry_name", ["trtllm", "mnnvl", "legacy"])
@pytest.mark.parametrize("facts_name", ["h200", "fabric-attr-only"])
def test_worked_examples(recorder, example, entry_name, facts_name):
    rec, keep = recorder
    ws, t, h, d = EXAMPLES[example]
    spec = runner.Spec(entry_name, ws, 0, t, h, d, facts_name)
    outcome = runner.run(flashinfer, rec, spec, keep)
    if RANGE == "R0" and entry_name != "legacy":
        assert outcome.status == "passthrough"  # no unified API in 0.5.x
        return
    assert outcome.status == "match", outcome.detail
    plan = outcome.plan
    captured_peak = sum(r.bytes for r in outcome.captured if r.held)
    captured_total = sum(r.bytes for r in outcome.captured)
    assert captured_peak == plan.peak_bytes
    _report("example", example=example, entry=entry_name, facts=facts_name,
            allocator=plan.allocator, captured_peak=captured_peak, plan_peak=plan.peak_bytes,
            captured_total=captured_total,
            creates=[r.bytes for r in outcome.captured if r.api == "cuMemCreate"])


def test_h200_measurement_of_section_9(recorder):
    """0.7.4 on the H200 of §9 (FABRIC attribute, no IMEX channel) recorded these
    cuMemCreate sizes for E1; the stand-ins must reproduce them from FlashInfer."""
    if RANGE != "R10":
        pytest.skip("measured with 0.7.4 only")
    rec, keep = recorder
    spec = runner.Spec("trtllm", 2, 0, 2048, 4096, "bfloat16", "fabric-attr-only")
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "match", outcome.detail
    assert [r.bytes for r in outcome.captured if r.api == "cuMemCreate"] == [
        35651584, 35651584, 2097152, 2097152, 102760448, 102760448]
    assert sum(r.bytes for r in outcome.captured
               if r.held and r.api == "cuMemCreate") == 134 * MiB
    assert isinstance(outcome.plan, Plan) and outcome.plan.peak_bytes >= 134 * MiB


def _cutedsl_planned() -> bool:
    return RANGE in rules.CUTEDSL_PLANNED_RANGES and not rules.is_unknown(VERSION)


def test_cutedsl_reference_example(recorder):
    """§5's mnnvl-cutedsl example (tp=8, H=8192, top_k=10, T=2048, cc 10.0): FlashInfer's
    constructor asks for symmetric blocks of 10, 50, 50, 2, 2, 34, 34 MiB, as planned."""
    if not _cutedsl_planned():
        pytest.skip("allocator D is planned for 0.7.4 only")
    rec, keep = recorder
    spec = runner.Spec("mnnvl-cutedsl-accepted", 8, 3, 2048, 8192, "bfloat16", "h200",
                       cc=(10, 0), options=(("top_k", 10),))
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "match", outcome.detail
    blocks = [r.bytes for r in outcome.captured if r.api == "cuMemCreate"]
    assert blocks == [n * MiB for n in (10, 50, 50, 2, 2, 34, 34)]
    assert type(keep[-1]).__name__ == "MNNVLCuteDSLAllReduceFusionWorkspace"
    _report("example", example="cutedsl-§5", entry="mnnvl-cutedsl", facts="h200",
            allocator="D", captured_peak=sum(r.bytes for r in outcome.captured),
            plan_peak=outcome.plan.peak_bytes, creates=blocks)


@pytest.mark.parametrize("change", ["byte", "drop"])
def test_cutedsl_comparison_detects_a_wrong_plan(recorder, monkeypatch, change):
    """Negative control for D: one byte more in a small tensor, or a missing
    peer-address table, is reported."""
    if not _cutedsl_planned():
        pytest.skip("allocator D is planned for 0.7.4 only")
    rec, keep = recorder
    spec = runner.Spec("mnnvl-cutedsl-accepted", 8, 0, 2048, 8192, "bfloat16", "h200",
                       cc=(10, 0))
    assert runner.run(flashinfer, rec, spec, keep).status == "match"
    real_plan = rules.plan_for

    def wrong(req, facts, version):
        plan = real_plan(req, facts, version)
        allocs = list(plan.allocations)
        i = next(i for i, a in enumerate(allocs) if a.name.endswith("peer_addresses"))
        if change == "byte":
            allocs[i] = dataclasses.replace(allocs[i], bytes=allocs[i].bytes + 1)
        else:
            del allocs[i]
        return dataclasses.replace(plan, allocations=tuple(allocs))

    monkeypatch.setattr(rules, "plan_for", wrong)
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "mismatch" and "differ" in outcome.detail


# The release the matrix runs for each range (scripts/conformance-matrix), by hand.
RANGE_OF_RELEASE = {
    "0.5.3": "R0", "0.6.6": "R1", "0.6.9": "R2", "0.6.10": "R3", "0.6.14": "R4",
    "0.6.15": "R5", "0.6.17": "R6", "0.7.1": "R7", "0.7.2": "R8", "0.7.2.post1": "R9",
    "0.7.4": "R10",
}


def test_the_range_matches_this_flashinfer():
    """The range the rules pick for the importable FlashInfer agrees with the table
    above and with the API FlashInfer itself exposes (entry points and parameters)."""
    if rules.is_unknown(VERSION):
        assert RANGE == rules.RANGES[-1][1]
    elif VERSION in RANGE_OF_RELEASE:
        assert RANGE == RANGE_OF_RELEASE[VERSION]
    t = rules.traits(VERSION)
    unified = getattr(flashinfer.comm, "create_allreduce_fusion_workspace", None)
    assert t.unified is (unified is not None)
    legacy = inspect.signature(flashinfer.comm.trtllm_create_ipc_workspace_for_all_reduce_fusion)
    assert (t.legacy_symm is not None) is ("use_symm_dev_mem" in legacy.parameters)
    if unified is not None:
        assert t.cutedsl_factory is ("top_k" in inspect.signature(unified).parameters)


def _issue_example_applies() -> bool:
    t = rules.traits(VERSION)
    return t.legacy_default == "C" and t.wide_fp32_buffer


def test_legacy_default_path_uses_the_installed_torch_pad(recorder):
    """Issue 11's example: 0.7.4's legacy default path (torch symmetric memory), ws 8,
    T 91, H 2880, fp32. With torch's real pad (9216 with torch 2.11+) FlashInfer's
    blocks are 10 + 2 + 26 MiB; a pad of 2048 would plan 8 + 2 + 24 MiB."""
    if not _issue_example_applies():
        pytest.skip("allocator C with 4-byte fp32 buffers: 0.7.2 and later")
    rec, keep = recorder
    spec = runner.Spec("legacy", 8, 0, 91, 2880, "float32", "h200")
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "match", outcome.detail
    blocks = [r.bytes for r in outcome.captured if r.api == "cuMemCreate"]
    pad = _facts.signal_pad()[0]
    assert outcome.plan.allocations[0].formula.endswith(f"P_t={pad}, G={2 * MiB})")
    if pad == 9216:
        assert blocks == [10 * MiB, 2 * MiB, 26 * MiB]


def test_a_stale_signal_pad_is_a_mismatch(recorder, monkeypatch):
    """Negative control: planning with 2048 while torch pads with its own value is
    reported (the false pass issue 11 found), unless torch's pad is 2048 itself."""
    if not _issue_example_applies():
        pytest.skip("allocator C with 4-byte fp32 buffers: 0.7.2 and later")
    if _facts.signal_pad()[0] == 2048:
        pytest.skip("this torch pads with 2048: a stale pad cannot show")
    rec, keep = recorder
    monkeypatch.setattr(_facts, "signal_pad", lambda: (2048, "stale"))
    spec = runner.Spec("legacy", 8, 0, 91, 2880, "float32", "h200")
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "mismatch" and "differ" in outcome.detail
    assert [a.bytes for a in outcome.plan.allocations if a.api == "cuMemCreate"] == [
        8 * MiB, 2 * MiB, 24 * MiB]


def test_multicast_granularity_is_asked_per_object_size(recorder):
    """Issue 11's example: 0.7.4 mnnvl, ws 4, T 777, H 1, fp16. FlashInfer asks the
    driver's multicast granularity for the 2 MiB object itself: where the driver answers
    by size (as H200's does) the buffer stays 2 MiB, as the shim's H200 rule plans."""
    if not rules.traits(VERSION).unified:
        pytest.skip("no mnnvl backend in 0.5.x")
    rec, keep = recorder
    sizes = {}
    for facts_name in ("h200-per-size", "h200"):
        spec = runner.Spec("mnnvl", 4, 1, 777, 1, "float16", facts_name)
        outcome = runner.run(flashinfer, rec, spec, keep)
        assert outcome.status == "match", outcome.detail
        sizes[facts_name] = [r.bytes for r in outcome.captured if r.api == "cuMemCreate"]
    if rules.traits(VERSION).mnnvl == "C":  # 0.6.10–0.6.14: torch symmetric memory, no Gmc
        assert sizes["h200-per-size"] == sizes["h200"] == [2 * MiB]
    else:
        assert sizes == {"h200-per-size": [2 * MiB], "h200": [512 * MiB]}
