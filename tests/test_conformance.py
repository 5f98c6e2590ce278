"""Conformance: FlashInfer's real workspace-creation code asks for exactly our plan.

FlashInfer (whichever release is importable: the installed one in CI, or one release
per range via scripts/conformance-matrix) runs on the CPU against recording
stand-ins for the CUDA driver/runtime, torch symmetric memory and the collectives
(tests/conformance/standins.py says what is replaced and why). Every allocation it
asks for — size, API, handle type, held or released, in order — must equal the plan
that flashinfer_safe_workspace computes for ``flashinfer.__version__``.

Set FIWS_CONFORMANCE_REPORT=<path> to append a JSON line per test with the counts
(scripts/conformance-matrix builds docs/fidelity.md from them).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time

import pytest

from conformance import runner, standins
from flashinfer_safe_workspace import _releases
from flashinfer_safe_workspace._plan import Plan

try:
    flashinfer = standins.import_flashinfer()
except Exception as exc:  # pragma: no cover - no flashinfer, or it cannot load on CPU
    pytest.skip(f"flashinfer not importable on this host: {exc!r}", allow_module_level=True)

VERSION = flashinfer.__version__
RANGE = _releases.range_of(VERSION)
MiB = 1 << 20


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
    real_plan = _releases.plan

    def off_by_one(req, facts, version):
        plan = real_plan(req, facts, version)
        first = dataclasses.replace(plan.allocations[0], bytes=plan.allocations[0].bytes + 1)
        return dataclasses.replace(plan, allocations=(first,) + plan.allocations[1:])

    monkeypatch.setattr(_releases, "plan", off_by_one)
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
    return RANGE in _releases.CUTEDSL_PLANNED_RANGES and not _releases.is_unknown(VERSION)


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
    real_plan = _releases.plan

    def wrong(req, facts, version):
        plan = real_plan(req, facts, version)
        allocs = list(plan.allocations)
        i = next(i for i, a in enumerate(allocs) if a.name.endswith("peer_addresses"))
        if change == "byte":
            allocs[i] = dataclasses.replace(allocs[i], bytes=allocs[i].bytes + 1)
        else:
            del allocs[i]
        return dataclasses.replace(plan, allocations=tuple(allocs))

    monkeypatch.setattr(_releases, "plan", wrong)
    outcome = runner.run(flashinfer, rec, spec, keep)
    assert outcome.status == "mismatch" and "differ" in outcome.detail


def test_version_is_known_or_newest():
    if _releases.is_unknown(VERSION):
        assert RANGE == "R10"
    else:
        assert RANGE == _releases.range_of(VERSION)
