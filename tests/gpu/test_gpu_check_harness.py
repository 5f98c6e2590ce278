"""CPU tests of the GPU-check harness itself (they run in CI; they need no GPU).

The analysis functions and the report generator are tested on synthetic input, and
``scripts/gpu-check --fake`` runs a few cases end to end against the CPU fakes of
``gpucheck_fake`` (gloo instead of NCCL, a byte counter instead of a GPU, FlashInfer's
0.7.4 allocation sequence imitated), including a real hang that the harness must kill.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-check")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_report  # noqa: E402
import gpucheck_cases as gcc  # noqa: E402

MiB = 1 << 20


# --------------------------------------------------------------------------- plan comparison


def _plan(*allocs):
    return {"allocations": [dict(zip(("name", "bytes", "api", "handle_type", "held"), a))
                            for a in allocs], "peak_bytes": 0}


E1_PLAN = _plan(
    ("trtllm.buffer", 35651584, "cuMemCreate", "fabric", False),
    ("trtllm.buffer", 35651584, "cuMemCreate", "posix", True),
    ("trtllm.buffer.uc_ptrs", 16, "cuMemAlloc", None, True),
    ("trtllm.flag", 2097152, "cuMemCreate", "fabric", False),
    ("trtllm.flag", 2097152, "cuMemCreate", "posix", True),
    ("trtllm.flag.uc_ptrs", 16, "cuMemAlloc", None, True),
    ("control_flag", 20, "cudaMalloc", None, True),
    ("workspace_table", 56, "torch", None, True),
)


def _recorded(reuse_handles: bool):
    """FABRIC create (export fails) + release, POSIX create, pointer array; twice.
    With reuse_handles the driver hands the released FABRIC handle value out again."""
    ev = []
    hid = 10
    for size in (35651584, 2097152):
        ev.append({"api": "cuMemCreate", "size": size, "handle": "fabric", "ok": True, "hid": hid})
        ev.append({"api": "cuMemRelease", "hid": hid, "ok": True})
        posix = hid if reuse_handles else hid + 1
        ev.append({"api": "cuMemCreate", "size": size, "handle": "posix", "ok": True, "hid": posix})
        ev.append({"api": "cuMemImportFromShareableHandle", "hid": posix + 100, "ok": True})
        ev.append({"api": "cuMemAddressReserve", "size": 2 * size, "ok": True})
        ev.append({"api": "cuMemAlloc", "size": 16, "ok": True})
        hid += 2
    ev.append({"api": "cudaMalloc", "size": 20, "ok": True})
    return ev


@pytest.mark.parametrize("reuse", [False, True])
def test_compare_plan_matches_fabric_attempt_then_posix(reuse):
    cmp_ = gcc.compare_plan(E1_PLAN, _recorded(reuse))
    assert cmp_["cumemcreate_match"], cmp_
    assert cmp_["driver_sequence_match"], cmp_
    assert cmp_["held_cumemcreate_actual"] == 35651584 + 2097152
    assert cmp_["imports"] == 2


def test_compare_plan_reports_the_first_difference():
    rec = _recorded(False)
    rec[2]["size"] += 2 * MiB
    cmp_ = gcc.compare_plan(E1_PLAN, rec)
    assert not cmp_["cumemcreate_match"]
    assert cmp_["cumemcreate_diff"]["index"] == 1
    rec = _recorded(False)[:-1]  # no cudaMalloc recorded
    cmp_ = gcc.compare_plan(E1_PLAN, rec)
    assert cmp_["cumemcreate_match"] and not cmp_["driver_sequence_match"]
    assert cmp_["sequence_diff"]["planned_len"] == cmp_["sequence_diff"]["actual_len"] + 1


def test_compare_plan_failed_create_is_not_held():
    plan = _plan(("b", 4 * MiB, "cuMemCreate", "posix", True))
    rec = [{"api": "cuMemCreate", "size": 4 * MiB, "handle": "posix", "ok": False, "hid": None}]
    assert not gcc.compare_plan(plan, rec)["cumemcreate_match"]


# --------------------------------------------------------------------------- sweep verdicts


@pytest.mark.parametrize("shim,unprotected,verdict", [
    ("created", None, "pass, FlashInfer succeeded"),
    ("flashinfer_error", None, "FALSE PASS"),
    ("blocked", None, "FALSE PASS"),
    ("vetoed", "created", "false veto"),
    ("vetoed", "flashinfer_error", "veto, FlashInfer alone raised"),
    ("vetoed", "blocked", "veto, FlashInfer alone blocked"),
    ("inconsistent", None, "INCONSISTENT"),
])
def test_classify_point(shim, unprotected, verdict):
    assert gcc.classify_point({"shim": shim, "unprotected": unprotected}).startswith(verdict)


def test_summarise_point_expected_decision_uses_the_probe_free_bytes():
    ctx = gcc.Ctx()
    p = {"idx": 0, "shape_name": "E1", "delta_mb": 0, "need": 100 * MiB, "plan_peak": 100 * MiB,
         "ranks": {0: {"starved": True, "free_before": 101 * MiB, "probe_free": 100 * MiB,
                       "shim": "created"},
                   1: {"starved": False, "free_before": 9000 * MiB, "shim": "created"}}}
    out = gcc._summarise_point(p, ctx)
    assert out["expected"] == "pass" and out["as_planned"] is True and out["margin"] == 0
    p["ranks"][1]["shim"] = "blocked"
    out = gcc._summarise_point(p, ctx)
    assert out["verdict"].startswith("FALSE PASS")


def test_merge_point_marks_the_blocked_call():
    ctx = gcc.Ctx()
    points = {3: {"idx": 3}}
    run = {"ranks": [{"events": [{"ev": "point_shim", "idx": 3, "outcome": "vetoed",
                                  "seconds": 0.1, "report": {}}]},
                     {"events": []}],
           "hang": {"ranks": [{"rank": 0, "label": "unprotected#3", "blocked_s": 41.0},
                              {"rank": 1, "label": "unprotected#3", "blocked_s": 41.0}]}}
    gcc._merge_point(points, run, ctx)
    assert points[3]["hung"] and points[3]["ranks"][0]["unprotected"] == "blocked"
    assert gcc._summarise_point(points[3], ctx)["verdict"] == "veto, FlashInfer alone blocked"


def test_finish_case_status():
    ok = gcc.check("a", True)
    bad = gcc.check("b", False)
    note = gcc.check("c", False, required=False)
    assert gcc.finish_case([ok, note], {}, [], "")["status"] == "pass"
    assert gcc.finish_case([ok, bad], {}, [], "")["status"] == "fail"
    assert gcc.finish_case([ok], {}, [], "", ["rank 0: boom"])["status"] == "error"
    assert gcc.finish_case([], {}, [], "")["status"] == "error"


def test_rank_env_keeps_multicast_off_and_drops_shim_variables(monkeypatch):
    monkeypatch.setenv("FLASHINFER_SAFE_WORKSPACE", "1")
    monkeypatch.setenv("FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB", "7")
    env = gcc.rank_env(gcc.Ctx(), {"NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert not any(k.startswith("FLASHINFER_SAFE_WORKSPACE") for k in env)
    env = gcc.rank_env(gcc.Ctx(), {"FLASHINFER_SAFE_WORKSPACE": "1"})
    assert env["FLASHINFER_SAFE_WORKSPACE"] == "1"


# --------------------------------------------------------------------------- report


def test_report_renders_the_sample_and_survives_missing_fields():
    text = gpu_report.render(gpu_report.sample_results())
    assert "## Command run on the GPU host" in text and "## Summary" in text
    assert "fake" in text.lower()
    broken = gpu_report.sample_results()
    broken["cases"]["a"]["data"] = {"creation": "not a list"}
    broken["env"] = None
    text = gpu_report.render(broken)
    assert "could not be rendered" in text or "## a." in text
    assert gpu_report.summary_table(broken).startswith("case")


def test_report_cli(tmp_path):
    src = tmp_path / "results.json"
    src.write_text(json.dumps(gpu_report.sample_results()))
    out = tmp_path / "report.md"
    assert gpu_report.main([str(src), "-o", str(out)]) == 0
    assert out.read_text().startswith("# GPU check report")


# --------------------------------------------------------------------------- the script


def test_dry_run():
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "case d:" in p.stdout and "report generator" in p.stdout


def test_unknown_case_is_an_argument_error():
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--cases", "a,z"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown case" in p.stderr


needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("torch") is None,
    reason="the fake end-to-end run imports torch and FlashInfer (no GPU needed)")


@needs_flashinfer
def test_fake_end_to_end_starved_cases_and_a_killed_hang(tmp_path):
    """b (shim: None / WorkspaceVetoed on both ranks) and c (no shim: warm -> both raise,
    cold -> one rank blocked, killed at the bound) against the fakes, then the report."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, SCRIPT, "--fake", "--cases", "b,c", "--hang-bound", "6",
                        "--budget", "300", "--out", str(out)],
                       capture_output=True, text=True, timeout=400)
    res = json.loads((out / "results.json").read_text())
    assert res["fake"] is True
    b, c = res["cases"]["b"], res["cases"]["c"]
    assert b["status"] == "pass", (b["summary"], b["checks"], b["errors"], p.stdout[-3000:])
    assert c["status"] == "pass", (c["summary"], c["checks"], c["errors"], p.stdout[-3000:])
    cold = [row for row in c["data"]["rows"] if row["nccl"] == "cold"]
    assert {row["outcome"]["kind"] for row in cold} == {"raised", "blocked"}
    warm = [row for row in c["data"]["rows"] if row["nccl"] == "warm"]
    assert {row["outcome"]["kind"] for row in warm} == {"raised"}
    report = (out / "report.md").read_text()
    assert "Before and after, same starvation" in report
    assert "blocked >= 6 s (killed)" in report
    assert p.returncode == 0, p.stdout[-3000:]


# --------------------------------------------------------------------------- rank-side pieces
# (with cuda-python's real types, and driver calls answered here: no driver needed)

needs_cuda_python = pytest.mark.skipif(importlib.util.find_spec("cuda") is None,
                                       reason="needs cuda-python (its types, not a driver)")


class _DriverCalls:
    """cuda.bindings.driver with the allocation calls answered from a byte counter."""

    def __init__(self, free: int, fail_above: int = 1 << 62):
        from cuda.bindings import driver

        self.real, self.free, self.fail_above = driver, free, fail_above
        self.live, self.next = {}, 1

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cuInit(self, flags):
        return (self.real.CUresult.CUDA_SUCCESS,)

    def cuMemGetAllocationGranularity(self, prop, flag):
        assert prop.location.id in (0, 1) and int(prop.requestedHandleTypes) != 0
        return (self.real.CUresult.CUDA_SUCCESS, 2 * MiB)

    def cuMemCreate(self, size, prop, flags):
        if size > self.free or size > self.fail_above:
            return (self.real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        self.free -= size
        hid = self.next
        self.next += 1
        self.live[hid] = size
        return (self.real.CUresult.CUDA_SUCCESS, self.real.CUmemGenericAllocationHandle(hid))

    def cuMemRelease(self, handle):
        self.free += self.live.pop(int(handle))
        return (self.real.CUresult.CUDA_SUCCESS,)

    def cuMemAlloc(self, size):
        return (self.real.CUresult.CUDA_SUCCESS, self.real.CUdeviceptr(4096))


@needs_cuda_python
@pytest.mark.parametrize("fail_above", [1 << 62, 3 * (1 << 30)])
def test_hog_leaves_the_target_on_the_granularity_grid(fail_above):
    import gpucheck_common

    drv = _DriverCalls(free=150 * (1 << 30) + 3 * MiB + 12345, fail_above=fail_above)
    device = type("Dev", (), {"rank": 0, "free": lambda self: drv.free})()
    hog = gpucheck_common.Hog(device, drv=drv)
    left = hog.fill(134 * MiB + 124)
    assert 134 * MiB + 124 <= left < 136 * MiB + 124
    assert int(hog.prop.requestedHandleTypes) == int(
        drv.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    assert hog.prop.allocFlags.gpuDirectRDMACapable == 1 and hog.prop.location.id == 0
    left = hog.set(64 * MiB)
    assert 64 * MiB <= left < 66 * MiB
    hog.release()
    assert drv.free == 150 * (1 << 30) + 3 * MiB + 12345 and not drv.live


@needs_cuda_python
def test_driver_recorder_records_and_delegates():
    import gpucheck_rank

    drv = _DriverCalls(free=1 << 40)
    events = []
    rec = gpucheck_rank._DriverRecorder(drv, events)
    prop = drv.real.CUmemAllocationProp()
    prop.requestedHandleTypes = drv.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    err, handle = rec.cuMemCreate(34 * MiB, prop, 0)
    assert int(err) == 0
    rec.cuMemRelease(handle)
    prop.requestedHandleTypes = drv.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    rec.cuMemCreate(34 * MiB, prop, 0)
    rec.cuMemAlloc(16)
    assert rec.CUresult is drv.real.CUresult  # everything else is the real module's
    assert [(e["api"], e.get("size"), e.get("handle")) for e in events] == [
        ("cuMemCreate", 34 * MiB, "fabric"), ("cuMemRelease", None, None),
        ("cuMemCreate", 34 * MiB, "posix"), ("cuMemAlloc", 16, None)]
    cmp_ = gcc.compare_plan(_plan(("b", 34 * MiB, "cuMemCreate", "fabric", False),
                                  ("b", 34 * MiB, "cuMemCreate", "posix", True),
                                  ("b.uc", 16, "cuMemAlloc", None, True)), events)
    assert cmp_["cumemcreate_match"] and cmp_["driver_sequence_match"], cmp_


@needs_flashinfer
def test_fake_sweep_false_pass_hang_is_killed_and_the_sweep_resumes(tmp_path):
    """d against fakes whose mappings take 900 KiB each that no plan counts: at +0 MiB
    (136 MiB free for 134 MiB planned) the shim passes, the starved rank runs out at the
    third mapping, after FlashInfer's vote, and its peer blocks: the harness reports a
    FALSE PASS, kills the run and resumes with the next point."""
    out = tmp_path / "out"
    shape = {"T": 2048, "H": 4096, "dtype": "bfloat16"}
    points = [{"idx": i, "shape_name": "E1", "shape": shape, "delta_mb": d}
              for i, d in enumerate((-2, 0, 8))]
    env = dict(os.environ, GPUCHECK_FAKE_MAP_BYTES=str(900 * 1024))
    p = subprocess.run([sys.executable, SCRIPT, "--fake", "--cases", "d", "--sweep-hang-bound", "5",
                        "--budget", "300", "--out", str(out),
                        "--override", json.dumps({"d": {"points": points}})],
                       capture_output=True, text=True, timeout=400, env=env)
    d = json.loads((out / "results.json").read_text())["cases"]["d"]
    verdicts = [pt["verdict"] for pt in d["data"]["points"]]
    assert verdicts[0] == "veto, FlashInfer alone raised", (verdicts, p.stdout[-3000:])
    assert verdicts[1] == "FALSE PASS: shim let it through, FlashInfer blocked", (verdicts, p.stdout[-3000:])
    assert verdicts[2] == "pass, FlashInfer succeeded", (verdicts, p.stdout[-3000:])
    assert d["data"]["runs"] == 2 and d["status"] == "fail"
    assert "FALSE PASS" in (out / "report.md").read_text()


SHIM_OFF_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import flashinfer_safe_workspace as fiws
fiws.install()                      # before FlashInfer is imported: the import hooks wrap
import flashinfer.comm as comm
from flashinfer.comm import allreduce, trtllm_ar
import gpucheck_rank

def ours(fn):
    return bool(getattr(fn, "_self_flashinfer_safe_workspace", False))

names = [(m, a) for m in (comm, allreduce, trtllm_ar) for a in gpucheck_rank.shim_off.NAMES
         if a in m.__dict__]
before = [ours(m.__dict__[a]) for m, a in names]
with gpucheck_rank.shim_off():
    during = [ours(m.__dict__[a]) for m, a in names]
after = [ours(m.__dict__[a]) for m, a in names]
print(before, during, after)
assert all(before) and not any(during) and all(after), (before, during, after)
"""


@needs_flashinfer
def test_shim_off_unwraps_every_binding_including_from_imports():
    p = subprocess.run([sys.executable, "-c", SHIM_OFF_PROBE, HERE], capture_output=True,
                       text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                    if not k.startswith("FLASHINFER_SAFE")})
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


# --------------------------------------------------------------------------- decision line

import gpucheck_common  # noqa: E402

NEW_LINE = ("[flashinfer_safe_workspace pid=4242] INFO fiws decision rank=0 pid=4242 outcome=veto "
            "entry=unified backend=trtllm ranks=0,1 device=cuda:0 plan_bytes=140509308 "
            "free_bytes=610271232 headroom_bytes=536870912 headroom=nccl-cold probe=no "
            "answer=raise caller=sglang.srt.layers.flashinfer_comm_fusion audit=- elapsed_ms=7.4")
OLD_LINE = ("fiws decision rank=1 pid=7 outcome=pass entry=legacy backend=trtllm ranks=0,1 "
            "device=- plan_bytes=-1 free_bytes=-1 probe=ok elapsed_ms=0.3")


def test_parse_decision_new_and_old_lines():
    new = gpucheck_common.parse_decision(NEW_LINE)
    assert new["outcome"] == "veto" and new["answer"] == "raise" and new["audit"] == "-"
    assert new["headroom"] == "nccl-cold" and new["headroom_bytes"] == 536870912
    assert new["plan_bytes"] == 140509308 and new["elapsed_ms"] == 7.4 and new["rank"] == 0
    assert new["caller"] == "sglang.srt.layers.flashinfer_comm_fusion" and new["ranks"] == "0,1"
    old = gpucheck_common.parse_decision(OLD_LINE)
    assert old["outcome"] == "pass" and old["free_bytes"] == -1 and "audit" not in old
    # extra fields, missing fields, odd tokens: still parsed, never raises
    odd = gpucheck_common.parse_decision("fiws decision outcome=pass junk new_field=x= audit=ok rank=-")
    assert odd == {"outcome": "pass", "new_field": "x=", "audit": "ok", "rank": "-"}
    assert gpucheck_common.parse_decision("vetoed FlashInfer all-reduce workspace creation") is None


def test_decision_log_captures_lines_without_importing_the_shim():
    import logging

    log = gpucheck_common.DecisionLog()
    mark = log.mark()
    logger = logging.getLogger("flashinfer_safe_workspace")
    logger.info("%s", OLD_LINE)
    logger.warning("vetoed on every rank: rank 0 short")
    got = log.since(mark)
    assert [d["outcome"] for d in got["decisions"]] == ["pass"]
    assert got["warnings"] == ["vetoed on every rank: rank 0 short"]
    assert log.since(log.mark()) == {"decisions": [], "warnings": []}
    mark = log.mark()
    logger.info("%s", NEW_LINE)
    logger.info("fiws audit rank=0 audit=ok observed=3")
    assert log.last_decision(mark)["audit"] == "ok"  # a later audit line fills audit=-


# --------------------------------------------------------------------------- case p analysis


@pytest.mark.parametrize("mode,caller,want", [
    ("none", "plain", "None"), ("none", "sglang", "None"), ("raise", "plain", gcc.VETOED),
    ("auto", "plain", "None"), ("auto", "sglang", gcc.VETOED), ("auto", "vllm", gcc.VETOED)])
def test_expected_answer(mode, caller, want):
    assert gcc.expected_answer(mode, caller) == want


def _protocol_run(steps, *, outcome, delta=0, lag=0.004, line=None, held=0, own=True,
                  free=None):
    """Two ranks' events. ``delta``: bytes a starved step leaves (free memory and what the
    rank holds alike); ``held``: bytes only the rank's own measures see; ``free(i, r)``: the
    device's free-memory delta alone (a peer on a shared device); ``own``: the ranks
    report their per-process measures."""
    ranks = []
    for r in range(2):
        evs = [{"ev": "activation", "fiws_imported_at_start": True, "unified_wrapped": True,
                "fiws_file": "/site-packages/flashinfer_safe_workspace/__init__.py"}]
        for i, step in enumerate(steps):
            got = outcome(step, r) if callable(outcome) else outcome
            start = 100.0 + i + (0.010 if r else 0.0)  # rank 1 arrives 10 ms later
            left = (delta if step["starve"] else 0) + (free(i, r) if free else 0)
            kept = (delta + held) if step["starve"] else 0
            ev = {"ev": "step", "i": i, "outcome": got, "seconds": 0.01,
                  "wall_start": start, "wall_end": 100.0 + i + 0.010 + lag,
                  "free_before": 1000, "free_after": 1000 - left,
                  "reserved_before": 0, "reserved_after": 0, "starved": r == 0,
                  "decisions": [line(step) if line else
                                {"outcome": "veto" if step["starve"] else "pass"}]}
            if own:
                ev["own_before"] = {"torch_reserved": 0, "driver_held": 4096, "nvml": None}
                ev["own_after"] = {"torch_reserved": 0, "driver_held": 4096 + kept,
                                   "nvml": None}
            evs.append(ev)
        ranks.append({"rank": r, "events": evs, "done": True, "killed": False,
                      "returncode": 0, "stderr_tail": []})
    return {"ranks": ranks, "hang": None}


def _want(mode):
    return lambda step, r: (gcc.expected_answer(mode, step["caller"]) if step["starve"]
                            else "created")


@pytest.mark.parametrize("mode", ["none", "raise", "auto"])
def test_analyse_protocol_passes_a_correct_run(mode):
    steps = gcc.protocol_steps(mode)
    rows, checks = gcc.analyse_protocol(mode, steps, _protocol_run(steps, outcome=_want(mode)),
                                        gcc.Ctx())
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert len(rows) == 2 * len(steps)
    assert any("50 ms" in c["name"] for c in checks) and any("0 bytes" in c["name"] for c in checks)


def test_analyse_protocol_catches_wrong_answers_leaks_lag_and_answer_fields():
    steps = gcc.protocol_steps("auto")
    ctx = gcc.Ctx()
    failed = lambda run: {c["name"] for c in gcc.analyse_protocol("auto", steps, run, ctx)[1]  # noqa: E731
                          if not c["ok"]}
    # auto unknown to the shim: None everywhere instead of WorkspaceVetoed for the engines
    bad = failed(_protocol_run(steps, outcome=lambda s, r: "None" if s["starve"] else "created"))
    assert any("sglang caller" in n and "WorkspaceVetoed" in n for n in bad)
    assert any("vllm caller" in n for n in bad) and not any("plain" in n for n in bad)
    # one rank answered differently
    bad = failed(_protocol_run(steps, outcome=lambda s, r: "None" if r == 1 and s["starve"]
                               else _want("auto")(s, r)))
    assert any("sglang caller" in n for n in bad)
    assert any("0 bytes" in n for n in failed(_protocol_run(steps, outcome=_want("auto"), delta=2 << 20)))
    assert any("50 ms" in n for n in failed(_protocol_run(steps, outcome=_want("auto"), lag=0.2)))
    wrong = lambda s: {"outcome": "veto" if s["starve"] else "pass", "answer": "none"}  # noqa: E731
    assert any("answer=raise" in n for n in failed(_protocol_run(steps, outcome=_want("auto"),
                                                                 line=wrong)))


PEER_GB = 2_900_000_000  # what the peer freed on the shared cuda:0 during case p at 7c21911


def test_a_veto_on_a_shared_device_is_judged_by_what_each_rank_holds():
    """Issue 30: at 7c21911 case p reported 42 of 43 on one H200. A cached veto (0.3 ms, no
    allocation) was charged -2.9 GB: the device's free memory, moved by the peer on the
    shared cuda:0. The 0-bytes check reads what each rank holds; the free-memory delta is
    shown beside it."""
    steps = gcc.protocol_steps("none")
    cached = next(i for i, s in enumerate(steps) if s.get("cached"))
    shared = gcc.Ctx(shared_device=True)
    assert shared.ranks_per_device == 2
    peer = lambda i, r: -PEER_GB if (i, r) == (cached, 1) else 0  # noqa: E731
    rows, checks = gcc.analyse_protocol("none", steps, _protocol_run(
        steps, outcome=_want("none"), free=peer), shared)
    zero = [c for c in checks if "0 bytes" in c["name"]]
    assert zero and all(c["ok"] for c in zero), zero
    row = next(x for x in rows if (x["step"], x["rank"]) == (cached, 1))
    assert (row["held_delta"], row["free_delta"]) == (0, -PEER_GB)
    assert f"-{PEER_GB}" in next(c["detail"] for c in zero if f"#{cached}" in c["name"])
    # what a rank itself keeps still fails the check, though the device's free memory
    # (the peer freeing as much) does not show it
    bad = gcc.analyse_protocol("none", steps, _protocol_run(
        steps, outcome=_want("none"), held=2 * MiB,
        free=lambda i, r: -2 * MiB if steps[i]["starve"] else 0), shared)[1]
    assert [c["ok"] for c in bad if "0 bytes" in c["name"]] == [False, False]


def test_without_a_per_process_measure_only_a_rank_alone_on_its_device_uses_free_memory():
    steps = gcc.protocol_steps("none")
    run = _protocol_run(steps, outcome=_want("none"), own=False)
    alone = [c for c in gcc.analyse_protocol("none", steps, run, gcc.Ctx())[1]
             if "0 bytes" in c["name"]]
    assert alone and all(c["ok"] for c in alone)
    shared = [c for c in gcc.analyse_protocol("none", steps, run,
                                              gcc.Ctx(shared_device=True))[1]
              if "0 bytes" in c["name"]]
    assert shared and not any(c["ok"] for c in shared)
    assert all("no per-process measure" in c["detail"] for c in shared)


def test_held_delta_adds_torch_and_the_driver_ledger_and_needs_both():
    before = {"torch_reserved": 2 * MiB, "driver_held": 10, "nvml": 500}
    after = {"torch_reserved": 4 * MiB, "driver_held": 0, "nvml": 900}
    assert gcc.held_delta(before, after) == 2 * MiB - 10
    assert gcc.held_delta(before, dict(after, driver_held=None)) is None
    assert gcc.held_delta(None, after) is None


def _fake_driver_module():
    import types

    mod = types.ModuleType("fake_driver")
    state = {"next": 100, "fail": False}

    def create(size, prop, flags):
        if state["fail"]:
            return (2,)
        state["next"] += 1
        return (0, state["next"])

    mod.cuMemCreate = create
    mod.cuMemRelease = lambda handle: (0,)
    mod.cuMemAlloc = lambda size: (0, 7000 + size)
    mod.cuMemFree = lambda ptr: (0,)
    mod.cuMemGetInfo = lambda: (0, 1, 2)  # left alone
    return mod, state


def test_driver_ledger_counts_what_this_process_holds():
    import gpucheck_common

    mod, state = _fake_driver_module()
    ledger = gpucheck_common.DriverLedger()
    ledger.install(mod)
    ledger.install(mod)  # the same module under a second name: wrapped once
    _, a = mod.cuMemCreate(2 * MiB, None, 0)
    _, b = mod.cuMemCreate(512 * MiB, None, 0)
    _, ptr = mod.cuMemAlloc(16)
    assert ledger.held == 514 * MiB + 16
    mod.cuMemRelease(a)
    mod.cuMemFree(ptr)
    assert ledger.held == 512 * MiB
    state["fail"] = True
    assert mod.cuMemCreate(MiB, None, 0) == (2,) and ledger.held == 512 * MiB  # not made
    mod.cuMemRelease(b)
    assert ledger.held == 0 and mod.cuMemGetInfo() == (0, 1, 2)


class _NvmlProc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


class _Nvml:
    def __init__(self, per_device):
        self.per_device = per_device

    def nvmlDeviceGetCount(self):
        return len(self.per_device)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.per_device[handle]


def test_nvml_measure_is_this_pid_s_memory_or_none():
    import gpucheck_common

    f = gpucheck_common.nvml_process_bytes
    peer_and_us = _Nvml([[_NvmlProc(11, 3 * (1 << 30)), _NvmlProc(22, 600 * MiB)], []])
    assert f(22, peer_and_us) == 600 * MiB  # the peer's 3 GiB on the same device: not ours
    assert f(33, peer_and_us) is None  # not listed (a container's pids are not the host's)
    assert f(22, _Nvml([[_NvmlProc(22, None)]])) is None  # no value
    assert f(22, _Nvml([[_NvmlProc(22, MiB)], [_NvmlProc(22, MiB)]])) == 2 * MiB


def test_audit_shapes_are_used_nowhere_else_in_the_repository():
    """The audit must run on shapes the plan was never checked on elsewhere."""
    import re

    pairs = {(sh["T"], sh["H"]) for _, sh in gcc.AUDIT_SHAPES}
    assert len(pairs) == 4
    hits = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "gpu")]
        for name in names:
            if not name.endswith((".py", ".md")):
                continue
            with open(os.path.join(base, name), errors="replace") as fh:
                text = fh.read()
            for t, h in pairs:
                if re.search(rf"\b{t}\b", text) and re.search(rf"\b{h}\b", text):
                    hits.append((name, t, h))
    assert not hits, hits


# --------------------------------------------------------------------------- q, k, l analysis


def test_tails_divide_a_shared_device_by_its_ranks():
    rows = [{"name": "s", "first": True, "plan_bytes": 100 * MiB, "free_delta": 2 * 110 * MiB},
            {"name": "s", "first": False, "plan_bytes": 100 * MiB, "free_delta": 2 * 102 * MiB},
            {"name": "s", "first": False, "plan_bytes": -1, "free_delta": 0}]  # no plan: skipped
    shared = gcc.analyse_tails([dict(r) for r in rows], gcc.Ctx(shared_device=True))
    assert shared["s"]["first"] == [10 * MiB] and shared["s"]["later"] == [2 * MiB]
    alone = gcc.analyse_tails([dict(r) for r in rows], gcc.Ctx())
    assert alone["s"]["first"] == [120 * MiB]


def test_bracket_finds_the_cold_need():
    pts = {32: {"verdict": "hung"}, 128: {"verdict": "raised"}, 256: {"verdict": "created"},
           512: {"verdict": "created"}}
    assert gcc.bracket(pts) == (128, 256)
    assert gcc.bracket({64: {"verdict": "created"}}) == (None, 64)
    assert gcc.bracket({64: {"verdict": "hung"}}) == (64, None)


def test_margins_false_veto_and_lower_bound():
    rows = [{"above_plan_mb": 100, "shim": "vetoed", "unprotected": "blocked", "verdict": "veto, FlashInfer alone blocked"},
            {"above_plan_mb": 300, "shim": "vetoed", "unprotected": "created", "verdict": "false veto: FlashInfer alone succeeded"},
            {"above_plan_mb": 520, "shim": "created", "unprotected": None, "verdict": "pass, FlashInfer succeeded"}]
    m = gcc.margins(rows)
    assert m["false_veto_margin_mb"] == 220 and m["largest_false_veto_mb"] == 300
    m = gcc.margins(rows[:2])
    assert "false_veto_margin_mb" not in m and m["false_veto_margin_at_least_mb"] == 0


# --------------------------------------------------------------------------- wheel and commit


def _gpu_check_module():
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("gpu_check_script", SCRIPT)
    spec = importlib.util.spec_from_loader("gpu_check_script", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_wheel_check_compares_every_file_with_the_tree():
    gc_script = _gpu_check_module()
    tree = gc_script.tree_files()
    assert "__init__.py" in tree and "_decide.py" in tree
    env = {"installed_package": {"dir": "/site/flashinfer_safe_workspace", "files": dict(tree)}}
    assert gc_script.wheel_check(env)["ok"]
    changed = dict(tree, **{"_decide.py": "0" * 64})
    w = gc_script.wheel_check({"installed_package": {"dir": "/site/x", "files": changed}})
    assert not w["ok"] and w["differ"] == ["_decide.py"]
    w = gc_script.wheel_check({"installed_package": {"dir": gcc.TREE_PACKAGE, "files": dict(tree)}})
    assert not w["ok"] and w["imported_from_tree"]
    assert not gc_script.wheel_check({"installed_package": "unavailable: ImportError"})["ok"]


def test_profiles_name_only_known_cases_and_one_gpu_leaves_out_two_gpu_cases():
    known = {k for k, *_ in gcc.CASES}
    assert all(set(v) <= known for v in gcc.PROFILES.values())
    assert not {"a", "b", "c", "d", "k", "l", "n"} & set(gcc.PROFILES["one"])
    assert {"p", "q"} <= set(gcc.PROFILES["one"]) and {"p", "k", "l", "n"} <= set(gcc.PROFILES["two"])


def test_rank_env_one_gpu_and_safe_path():
    env = gcc.rank_env(gcc.Ctx(shared_device=True))
    assert env["GPUCHECK_SHARED_DEVICE"] == "1" and env["GPUCHECK_WORLD_BACKEND"] == "gloo"
    assert env["PYTHONSAFEPATH"] == "1"
    env = gcc.rank_env(gcc.Ctx())
    assert "GPUCHECK_SHARED_DEVICE" not in env and env["PYTHONSAFEPATH"] == "1"
    ctx = gcc.Ctx()
    assert not os.path.abspath(ctx.workdir()).startswith(ROOT + os.sep)
    assert os.path.isfile(os.path.join(ctx.workdir(), "callers", "sglang", "fiws_probe_caller.py"))
    folder = ctx.workdir()
    ctx.cleanup()
    assert not os.path.exists(folder)


def test_dry_run_one_gpu_lists_its_cases():
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--one-gpu"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "case p:" in p.stdout and "case q:" in p.stdout and "case d:" not in p.stdout
    assert "budget 360 s" in p.stdout


# --------------------------------------------------------------------------- report with older runs


def test_report_keeps_older_cases_marked_with_their_commit():
    new = gpu_report.sample_results()
    new.update(profile="one", profile_name="one-GPU", commit={"commit": "abcdef0123", "source": "git"},
               order=["a"])
    old = gpu_report.sample_results()
    old.pop("profile", None)
    old["commit_label"] = "6673930"
    old["cases"]["g"] = dict(old["cases"]["c"], status="pass", summary="old overhead")
    text = gpu_report.render(new, (old,))
    assert "one-GPU, at commit abcdef0" in text
    assert "*Earlier run: two-GPU at commit 6673930; not re-run at this commit.*" in text
    assert text.count("## a. ") == 1  # the new run's a replaces the old one
    summary = gpu_report.summary_table(new)
    assert summary.startswith("case")
    assert "Other evidence from the two-GPU host (commit 6673930)" in text


def test_report_cli_with_older_file(tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text(json.dumps(dict(gpu_report.sample_results(), profile="one")))
    old.write_text(json.dumps(gpu_report.sample_results()))
    out = tmp_path / "report.md"
    assert gpu_report.main([str(new), str(old), "--older-commit", "6673930", "-o", str(out)]) == 0
    assert "commit 6673930" in out.read_text()


# --------------------------------------------------------------------------- fake end to end, new cases

def _auto_known() -> bool:
    return importlib.util.find_spec("flashinfer_safe_workspace._caller") is not None


@needs_flashinfer
def test_fake_one_gpu_protocol_and_audit_cases(tmp_path):
    """p (three modes through the .pth, engine-named callers) and q (two shapes) against
    the fakes: none and raise answer as asked on every rank, a veto leaves 0 bytes, the
    ranks answer within 50 ms; auto passes once the installed shim knows it."""
    out = tmp_path / "out"
    shapes = [{"name": n, "shape": sh} for n, sh in gcc.AUDIT_SHAPES[:2]]
    p = subprocess.run([sys.executable, SCRIPT, "--fake", "--one-gpu", "--cases", "p,q",
                        "--budget", "300", "--out", str(out),
                        "--override", json.dumps({"q": {"shapes": shapes}})],
                       capture_output=True, text=True, timeout=400)
    res = json.loads((out / "results.json").read_text())
    assert res["profile"] == "one" and res["wheel"]["ok"], (res.get("wheel"), p.stdout[-2000:])
    pc = res["cases"]["p"]
    by_name = {c["name"]: c for c in pc["checks"]}
    for name, c in by_name.items():
        if name.startswith(("none", "raise")) or "0 bytes" in name or "50 ms" in name:
            assert c["ok"], (name, c["detail"], p.stdout[-3000:])
    if _auto_known():
        assert pc["status"] == "pass", [c for c in pc["checks"] if not c["ok"]]
    else:  # before ON_VETO=auto exists: the engines' calls get None, and the check says so
        assert pc["status"] == "fail"
        assert all("rank 0: None" in c["detail"] for c in pc["checks"]
                   if not c["ok"] and "caller" in c["name"])
    q = res["cases"]["q"]
    rows = q["data"]["rows"]
    assert len(rows) == 2 * 3 * 2 and all(r["outcome"] == "created" for r in rows)
    tails = q["data"]["tails"]
    assert set(tails) == {s["name"] for s in shapes}
    assert all(t["first"] and t["later"] for t in tails.values())
    audit_check = next(c for c in q["checks"] if c["name"].startswith("audit=ok"))
    assert audit_check["ok"] == all(r["audit"] == "ok" for r in rows)
    report = (out / "report.md").read_text()
    assert "## p. " in report and "## q. " in report and "one-GPU" in report


@needs_flashinfer
def test_fake_two_gpu_cold_boundary_shim_margin_and_allocator_c(tmp_path):
    """k finds the fakes' NCCL start-up need (300 MiB above the plan) between two points,
    killing the hung ones; l runs the shim across it with no false pass; n compares
    torch's real signal pad rounding with the plan, buffer by buffer."""
    out = tmp_path / "out"
    over = {"k": {"coarse_mb": [128, 512], "fine_steps": 2},
            "l": {"variants": ["nccl-cold"], "points_nccl-cold": [256, 516]}}
    p = subprocess.run([sys.executable, SCRIPT, "--fake", "--two-gpu", "--cases", "k,l,n",
                        "--cold-hang-bound", "5", "--budget", "400", "--out", str(out),
                        "--override", json.dumps(over)],
                       capture_output=True, text=True, timeout=500)
    res = json.loads((out / "results.json").read_text())
    k = res["cases"]["k"]
    assert k["status"] == "pass", (k["summary"], p.stdout[-3000:])
    assert k["data"]["lo_mb"] < 300 <= k["data"]["hi_mb"], k["data"]
    assert any(pt["verdict"] == "hung" for pt in k["data"]["points"])
    l_ = res["cases"]["l"]
    verdicts = {pt["above_plan_mb"]: pt["verdict"] for pt in l_["data"]["points"]}
    assert verdicts[516] == "pass, FlashInfer succeeded", (verdicts, p.stdout[-3000:])
    assert verdicts[256].startswith("veto"), verdicts
    assert not any(c["name"].startswith("no false pass") and not c["ok"] for c in l_["checks"])
    n = res["cases"]["n"]
    rows = n["data"]["rows"]
    assert len(rows) == 4 and all(r["measured_buffers"] for r in rows)
    pad = rows[0]["signal_pad"]
    # ws 2 T34 H5120: lamport 3 x 696320 B; + pad 9216 crosses 2 MiB (+2048 would not)
    bf16 = next(r for r in rows if "T34" in r["name"])
    assert bf16["measured_buffers"][2] == (4 * MiB if pad == 9216 else 2 * MiB)
    match = next(c for c in n["checks"] if c["name"].startswith("each torch"))
    assert match["ok"] == all(r["planned_buffers"] == r["measured_buffers"] for r in rows)
    assert "## k. " in (out / "report.md").read_text()
