"""CPU tests of gpu-check's case w (the one-GPU hang, issue 23): they run in CI, no GPU.

``scripts/gpu-check --fake --one-gpu --cases w`` runs both variants end to end against
the CPU fakes (``GPUCHECK_FAKE_ALLOCATOR=B3``: 0.7.2.post1's procedure, no vote around
cuMemCreate): without the shim the peer must really block and be killed at the bound;
with it both ranks must get None without entering FlashInfer. The analysis, the peer's
entry watch and the report section are also tested on their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-check")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_report  # noqa: E402
import gpucheck_cases as gcc  # noqa: E402
import gpucheck_hang as gch  # noqa: E402
import gpucheck_hang_rank as ghr  # noqa: E402

needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("torch") is None,
    reason="the fake end-to-end run imports torch and FlashInfer (no GPU needed)")


# --------------------------------------------------------------------------- end to end


@needs_flashinfer
def test_fake_hang_case_w_blocks_without_the_shim_and_answers_none_with_it(tmp_path):
    out = tmp_path / "out"
    bound = 8
    p = subprocess.run([sys.executable, SCRIPT, "--fake", "--one-gpu", "--cases", "w",
                        "--w-bound", str(bound), "--budget", "300", "--out", str(out)],
                       capture_output=True, text=True, timeout=400)
    res = json.loads((out / "results.json").read_text())
    w = res["cases"]["w"]
    assert w["status"] == "pass", ([c for c in w["checks"] if not c["ok"]], w["errors"],
                                   p.stdout[-3000:])
    rows = {(r["variant"], r["rank"]): r for r in w["data"]["rows"]}
    # without the shim: the starved rank raised at once, the peer was still inside at the bound
    assert rows["off", 0]["starved"] and rows["off", 0]["outcome"]["kind"] == "raised"
    assert "OUT_OF_MEMORY" in rows["off", 0]["outcome"]["msg"]
    assert rows["off", 1]["blocked_at_bound"] and rows["off", 1]["outcome"]["blocked_s"] >= bound
    assert all(rows["off", r]["entered_flashinfer"] for r in (0, 1))
    assert rows["off", 0]["alive_after_answer"] is True
    assert "fake_exchange_fds" in w["data"]["variants"]["off"]["stacks"]["1"]
    # with the shim: None on both, FlashInfer never entered, nobody blocked
    for r in (0, 1):
        row = rows["on", r]
        assert row["outcome"]["kind"] == "returned" and row["outcome"]["note"] == "None", row
        assert row["entered_flashinfer"] == [] and not row["blocked_at_bound"]
        assert row["seconds"] < bound and row["alive_after_answer"] is True
        assert row["decisions"][-1]["outcome"] == "veto"
    # the memory was taken after the peer's observed entry, in both variants
    for variant, target in (("off", "gpucheck_fake:fake_exchange_fds"),
                            ("on", "flashinfer_safe_workspace.agreement.driver:vote")):
        sync = w["data"]["variants"][variant]["sync"]
        assert sync["observed"] and sync["peer_target"] == target, sync
        assert sync["hog_after_entry_s"] >= 0 and sync["peer_inside_at_hog"], sync
    report = (out / "report.md").read_text()
    assert "## w. " in report and f"Still blocked at {bound} s" in report
    assert "| without the shim | 1 | peer (calls first) | yes | no answer" in report
    assert p.returncode == 0, p.stdout[-3000:]


def test_dry_run_lists_case_w_and_compiles_its_rank_script():
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--one-gpu", "--cases", "w"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "case w:" in p.stdout and "gpucheck_hang_rank.py: ok" in p.stdout


def test_case_w_needs_no_kernel_and_is_in_no_default_profile():
    assert "w" in gcc.NO_KERNEL_CASES and "w" in gcc.CASE_TITLES
    # it needs the 0.7.2.post1 bundle: a default run (0.7.4 bundle) must not pick it up
    assert all("w" not in cases for cases in gcc.PROFILES.values())


# --------------------------------------------------------------------------- analysis


def _row(variant, rank, kind, *, note=None, seconds=0.02, entered=(), starved=None):
    o = {"kind": kind}
    if kind in ("returned", "raised"):
        o.update(seconds=seconds, note=note, type="builtins.RuntimeError", msg="x")
    else:
        o["blocked_s"] = seconds
    answered = kind in ("returned", "raised")
    return {"variant": variant, "rank": rank, "starved": rank == 0 if starved is None else starved,
            "outcome": o, "text": gch.outcome_text(o, 75), "seconds": seconds,
            "blocked_at_bound": kind == "blocked", "entered_flashinfer": list(entered),
            "alive_after_answer": True if answered else None, "flashinfer": "0.7.2.post1",
            "shim_imported": variant == "on", "shim_at_start": variant == "on",
            "wrapped": variant == "on", "decisions": [{"outcome": "veto"}] if variant == "on" else []}


GOOD_SYNC = {"observed": True, "waited_s": 0.01, "peer_target": "m:f", "hog_after_entry_s": 0.002,
             "peer_inside_at_hog": True, "hog_left": 16 << 20}
CFG = dict(gch.DEFAULTS)


def _failed(variant, rows, sync=GOOD_SYNC, stacks=None):
    checks = gch.variant_checks(variant, rows, sync, stacks or {}, CFG, gcc.Ctx())
    return [c["name"] for c in checks if not c["ok"] and c["required"]]


def test_variant_checks_pass_the_expected_runs():
    on = [_row("on", 0, "returned", note="None"), _row("on", 1, "returned", note="None")]
    off = [_row("off", 0, "raised", entered=["fi"]), _row("off", 1, "blocked", seconds=75.0,
                                                          entered=["fi"])]
    assert _failed("on", on) == [] and _failed("off", off) == []


def test_variant_checks_catch_a_wrong_outcome_each():
    on = [_row("on", 0, "returned", note="None"), _row("on", 1, "returned", note="None")]
    entered = [on[0], _row("on", 1, "returned", note="None", entered=["fi"])]
    assert _failed("on", entered) == ["with the shim: no rank entered FlashInfer"]
    blocked = [on[0], _row("on", 1, "blocked", seconds=75.0)]
    assert any("None on every rank" in n for n in _failed("on", blocked))
    created = [on[0], _row("on", 1, "returned", note="TRTLLMAllReduceFusionWorkspace")]
    assert any("None on every rank" in n for n in _failed("on", created))
    too_late = [on[0], _row("on", 1, "returned", note="None", seconds=121.0)]
    assert any("vote timeout" in n for n in _failed("on", too_late))
    off = [_row("off", 0, "raised"), _row("off", 1, "blocked", seconds=75.0)]
    answered = [off[0], _row("off", 1, "raised")]
    assert any("still blocked" in n for n in _failed("off", answered))
    early = dict(GOOD_SYNC, hog_after_entry_s=-0.5)  # memory taken before the peer entered
    assert any("only after the peer entered" in n for n in _failed("off", off, early))
    unseen = dict(GOOD_SYNC, observed=False)
    assert any("only after the peer entered" in n for n in _failed("on", on, unseen))
    gone = dict(GOOD_SYNC, peer_inside_at_hog=False)  # the peer had already answered
    assert any("only after the peer entered" in n for n in _failed("on", on, gone))
    died = [dict(off[0], alive_after_answer=False), off[1]]
    assert any("still alive" in n for n in _failed("off", died))


def test_outcome_text_uses_milliseconds_below_a_second():
    assert gch.outcome_text({"kind": "returned", "seconds": 0.042, "note": "None"}, 75) == \
        "returned (None) after 42 ms"
    assert gch.outcome_text({"kind": "raised", "seconds": 0.002, "type": "builtins.RuntimeError"},
                            75) == "raised RuntimeError after 2 ms"
    assert gch.outcome_text({"kind": "blocked", "blocked_s": 75.0}, 75) == "blocked >= 75 s (killed)"


# --------------------------------------------------------------------------- the entry watch


def _module(name: str, source: str):
    mod = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
    return mod


def test_watch_sees_the_first_entry_signals_once_and_changes_nothing(tmp_path):
    agreement = _module("pkg.agreement.round", "def vote(x):\n    return x * 2\n")
    other = _module("pkg.other", "def vote(x):\n    return x + 1\n")
    fi = _module("fi.comm", "def create(x):\n    return ('made', x)\n")
    signal = str(tmp_path / ghr.SIGNAL)
    watch = ghr.Watch(1, ["pkg.agreement.*:vote"], ["fi.comm:create"], signal)
    watch.start()
    try:
        assert other.vote(1) == 2  # same name, other module: not a target
        assert not os.path.exists(signal)
        assert agreement.vote(3) == 6 and agreement.vote(4) == 8
        result = []
        t = threading.Thread(target=lambda: result.append(fi.create(5)))  # another thread
        t.start()
        t.join(10)
    finally:
        watch.stop()
    assert sys.getprofile() is None
    assert result == [("made", 5)]
    assert [(h["kind"], h["target"]) for h in watch.hits] == [
        ("sync", "pkg.agreement.round:vote"), ("flashinfer", "fi.comm:create")]
    with open(signal) as fh:
        rec = json.load(fh)
    assert rec["target"] == "pkg.agreement.round:vote" and rec["rank"] == 1
    assert rec["stack"][-1].startswith("vote (")
    assert [n for n in os.listdir(tmp_path) if n != ghr.SIGNAL] == []  # no temp file left


def test_watch_never_lets_an_error_into_the_watched_code(tmp_path):
    mod = _module("pkg.agreement.x", "def vote():\n    return 'ok'\n")
    watch = ghr.Watch(1, ["pkg.agreement.*:vote"], [], str(tmp_path / "missing" / "signal"))
    watch.start()
    try:
        assert mod.vote() == "ok"  # writing the signal fails (no such folder)
    finally:
        watch.stop()


def test_wait_for_peer_is_bounded_and_reads_the_record(tmp_path):
    path = str(tmp_path / ghr.SIGNAL)
    wait = 0.2
    start = time.monotonic()
    got = ghr.wait_for_peer(path, wait)
    # returns once its bound is over; the upper bound is slack that scales with the wait
    assert not got["observed"] and wait <= time.monotonic() - start < 25 * wait
    with open(path, "w") as fh:
        json.dump({"target": "m:f", "t": 1.0}, fh)
    got = ghr.wait_for_peer(path, 0.2)
    assert got["observed"] and got["peer"]["target"] == "m:f"


# --------------------------------------------------------------------------- the report


def test_report_section_of_case_w_and_missing_fields():
    on = [_row("on", 0, "returned", note="None"), _row("on", 1, "returned", note="None",
                                                       seconds=0.042)]
    off = [_row("off", 0, "raised", entered=["fi"]), _row("off", 1, "blocked", seconds=75.0,
                                                          entered=["fi"])]
    stack = ('Thread 0x1 (most recent call first):\n'
             '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 9 in all_gather\n'
             '  File "/tmp/site/flashinfer/comm/fd_exchange.py", line 137 in exchange_fds\n')
    case = {"status": "pass", "title": "hang", "summary": "s", "wall_s": 90.0, "checks": [],
            "data": {"params": dict(gch.DEFAULTS), "rows": off + on,
                     "variants": {"off": {"sync": dict(GOOD_SYNC, peer_stack=["a (f:1)"]),
                                          "stacks": {"1": stack}},
                                  "on": {"sync": GOOD_SYNC, "stacks": {}}}}}
    text = "\n".join(gpu_report.RENDERERS["w"](case))
    assert "| without the shim | 1 | peer (calls first) | yes | no answer: still inside the " \
           "call at 75 s, killed | 75.0 s | **yes** | n/a (no answer) |" in text
    assert "| with the shim | 1 | peer (calls first) | no | returned None | 42 ms | no | yes |" in text
    assert "flashinfer/comm/fd_exchange.py:137 in exchange_fds" in text and "/tmp/" not in text
    assert "the slower answer took 42 ms" in text
    assert gpu_report.RENDERERS["w"]({})  # nothing to show: no exception
    res = gpu_report.sample_results()
    res["cases"]["w"], res["order"] = case, ["w"]
    assert "## w. hang" in gpu_report.render(res)
