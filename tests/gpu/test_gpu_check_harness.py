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
