"""One test per failure mode (docs/failure-modes.md), on real gloo ranks with the simulated
device's facts set per rank: the same answer on every rank, the check and reason code
named, FlashInfer entered on no rank where the release would fail (and entered where it
handles the case itself)."""

from __future__ import annotations

import pytest

from harness import results, run_ranks
from flashinfer_safe_workspace import _reasons as R
import flashinfer_safe_workspace.checks  # noqa: F401 - imported before any test's strict recorder

BODY = """
import rank_lib, flashinfer
from flashinfer_safe_workspace import _config
from flashinfer_safe_workspace.planning import probe as _probe
VERSION = {version!r}
if VERSION:
    flashinfer.__version__ = VERSION  # plan with that release's rules
SIM = {sim}
dev = rank_lib.setup(free_mb=None, sim=SIM.get(RANK, {{}}), on_veto="raise")
outcome, secs, err = rank_lib.create(rank=RANK, backend={backend!r})
d = rank_lib.last_decision() or {{}}
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls),
              check=d.get("check"), exports=getattr(dev, "exports_live", 0),
              reasons=rank_lib.last_reasons, line_reasons=d.get("reasons"))
"""


DEEP_KEYS = """
import datetime
from flashinfer_safe_workspace.checks import deep as _deep
_st = dist.distributed_c10d._get_default_store()
_st.set(f"t/deep-done/{{RANK}}", "1")  # every rank through its decision, then look
_st.wait([f"t/deep-done/{{r}}" for r in range(WORLD)], datetime.timedelta(seconds=30))
_keys = list(_deep.keys_of_last_run())
result.update(deep_keys=len(_keys), deep_left=sum(_st.check([k]) for k in _keys))
"""


def run(sim, *, backend="trtllm", version="", env=None, rank_env=None, world=2, extra="",
        internal_errors=()):
    body = BODY.format(sim=repr(sim), backend=backend, version=version) + extra.format()
    return results(run_ranks(world, body, env=env, rank_env=rank_env, timeout=120,
                             internal_errors=internal_errors))


def _carries(r, code) -> bool:
    """The rank's veto carries ``code`` by name (WorkspaceVetoed.reasons and its decision
    line's ``reasons=``), also on a rank that arrived after the register was decided: the
    register carries the deciding cause's codes."""
    name = R.NAMES[code]
    return name in (r["reasons"] or []) and name in (r["line_reasons"] or [])


def assert_vetoed(rs, check, code):
    assert any(R.NAMES[code] in (r["reasons"] or []) for r in rs), rs  # the code, by name
    for r in rs:
        assert r["outcome"] == "vetoed", r
        assert r["calls"] == 0, r  # FlashInfer entered on no rank
        assert r["check"] == check, r
        assert check == "memory" or f"check {check}" in r["err"], r
        assert (R.REASON_TEXT[code] if check != "memory" else "OUT_OF_MEMORY") in r["err"], r
        assert _carries(r, code), r
        assert "Traceback" not in r["err"]


def assert_created(rs):
    for r in rs:
        assert r["outcome"] == "created" and r["calls"] == 1, r


# TP=2 x DP=2 over 4 ranks: the comm backend an engine passes (a torch group inside)
TP_GROUPS = """
class TorchDistBackend:
    def __init__(self, group): self._group = group
    def Get_rank(self): return dist.get_rank(self._group)
    def Get_size(self): return dist.get_world_size(self._group)
tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
tp = tps[RANK // 2]
"""


def test_mode1_rendezvous_group_is_world_on_0_6_10():
    """TP=2 x DP=2: the comm backend is the TP group, FlashInfer 0.6.10 rendezvouses on
    WORLD (4 ranks): every rank vetoes (check group); 0.7.4 creates."""
    body = """
import rank_lib, flashinfer
flashinfer.__version__ = VERSION
""" + TP_GROUPS + """
rank_lib.setup(free_mb=None, on_veto="raise")
outcome, secs, err = rank_lib.create(rank=RANK % 2, comm_backend=TorchDistBackend(tp))
d = rank_lib.last_decision() or {}
result.update(outcome=outcome, err=err, calls=len(rank_lib.calls), check=d.get("check"),
              secs=secs, reasons=rank_lib.last_reasons, line_reasons=d.get("reasons"))
"""
    old = results(run_ranks(4, "VERSION = '0.6.10'\n" + body, timeout=120))
    assert_vetoed(old, "group", R.RENDEZVOUS_GROUP)
    assert all("WORLD" in r["err"] for r in old)
    new = results(run_ranks(4, "VERSION = '0.7.4'\n" + body, timeout=120))
    assert_created(new)


def test_mode1_group_given_is_the_tp_group_on_0_6_10():
    """TP=2 x DP=2 on 0.6.10 again, now with ``group=`` the TP group: FlashInfer rendezvouses
    on it, so every rank creates. The check reads that group's size and this rank's place in
    it, not WORLD's (4 ranks): reading WORLD's there vetoes every rank (mutation testing,
    ``checks.group`` ``x_local__mutmut_21``/``_24``, which one process cannot tell apart)."""
    body = """
import rank_lib, flashinfer
flashinfer.__version__ = '0.6.10'
""" + TP_GROUPS + """
rank_lib.setup(free_mb=None, on_veto="raise")
outcome, secs, err = rank_lib.create(rank=RANK % 2, comm_backend=TorchDistBackend(tp), group=tp)
d = rank_lib.last_decision() or {}
result.update(outcome=outcome, err=err, calls=len(rank_lib.calls), check=d.get("check"),
              secs=secs, reasons=rank_lib.last_reasons, line_reasons=d.get("reasons"))
"""
    assert_created(results(run_ranks(4, body, timeout=120)))


def test_mode2_device_is_tp_rank_before_0_6_7():
    rs = run({}, version="0.6.5")  # both ranks on cuda:0; 0.6.5 allocates on cuda:tp_rank
    assert_vetoed(rs, "device", R.DEVICE_MISMATCH)
    assert all("rank 1" in r["err"] and "planned=cuda:1" in r["err"] for r in rs)


def test_mode2_shared_gpu_vetoed_for_multicast_allowed_for_trtllm():
    same = {0: {"gpu_uuid": "GPU-0"}, 1: {"gpu_uuid": "GPU-0"}}
    assert_vetoed(run(same, backend="mnnvl"), "gpus", R.SHARED_GPU)
    assert_created(run(same, backend="trtllm"))  # FlashInfer 0.7.4 handles it: allowed


@pytest.mark.parametrize("where", ["one", "both"])
def test_mode3_named_mnnvl_without_multicast(where):
    sim = {1: {"multicast": False}} if where == "one" else {0: {"multicast": False},
                                                              1: {"multicast": False}}
    rs = run(sim, backend="mnnvl")
    assert_vetoed(rs, "multicast", R.NO_MULTICAST)
    assert all("multicast=0" in r["err"] for r in rs)


def test_mode4_confidential_compute():
    both = {r: {"FLASHINFER_CONFIDENTIAL_COMPUTE": "1"} for r in (0, 1)}
    assert_vetoed(run({}, backend="mnnvl", rank_env=both), "multicast", R.CONFIDENTIAL_COMPUTE)
    one = {1: {"FLASHINFER_CONFIDENTIAL_COMPUTE": "1"}}
    assert_vetoed(run({}, backend="trtllm", rank_env=one), "multicast", R.CONFIDENTIAL_COMPUTE)


def test_mode5_fabric_not_ready():
    sim = {0: {"fabric_state": 2, "fabric": True}}
    assert_vetoed(run(sim, backend="mnnvl"), "fabric", R.FABRIC_NOT_READY)
    bad_status = {1: {"fabric_state": 3, "fabric_status": 1, "cluster_uuid": "ab" * 16}}
    assert_vetoed(run(bad_status, backend="mnnvl"), "fabric", R.FABRIC_NOT_READY)


def test_mode6_ranks_span_hosts():
    sim = {0: {"host": "node-a/1"}, 1: {"host": "node-b/2"}}
    rs = run(sim, version="0.7.2")
    assert_vetoed(rs, "hosts", R.HOSTS_SPAN)
    assert all("node-a" in r["err"] and "node-b" in r["err"] for r in rs)
    assert_created(run(sim, version="0.7.4"))  # 0.7.4 votes and raises on every rank itself


def test_mode7_handle_types_differ_and_fabric_without_imex():
    fab = {"fabric": True, "fabric_state": 3, "cluster_uuid": "cd" * 16}
    differ = {0: dict(fab, imex_channel=True), 1: {}}
    assert_vetoed(run(differ, version="0.7.2"), "handles", R.HANDLE_MISMATCH)
    no_imex = {0: fab, 1: fab}
    assert_vetoed(run(no_imex, version="0.7.2"), "handles", R.NO_IMEX)
    assert_created(run(no_imex, version="0.7.4"))  # 0.7.4 falls back to POSIX itself


def test_mode8_9_deep_probe_import_fails():
    env = {"FLASHINFER_SAFE_WORKSPACE_DEEP_PROBE": "1"}
    rs = run({1: {"refuse_import": True}}, env=env, extra=DEEP_KEYS)
    assert_vetoed(rs, "deep", R.DEEP_PROBE_FAILED)
    assert all(r["exports"] == 0 for r in rs)  # released on every path
    ok = run({}, env=env, extra=DEEP_KEYS)
    assert_created(ok)
    assert all(r["exports"] == 0 for r in ok)
    for r in rs + ok:  # the round's store keys are gone once every rank is through
        assert r["deep_keys"] > 0 and r["deep_left"] == 0, r


def test_mode10_capture_vetoed_on_every_rank():
    assert_vetoed(run({0: {"capturing": True}}), "capture", R.CAPTURING)


def test_mode11_package_versions():
    pk = [("flashinfer-python", "0.7.4"), ("flashinfer-cubin", "0.7.3"), ("flashinfer-jit-cache", "")]
    assert_vetoed(run({1: {"packages": pk}}), "packages", R.PACKAGE_MISMATCH)


def test_mode12_memory_is_a_check():
    rs = run({}, env={"FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB": str(1 << 20)})
    assert_vetoed(rs, "memory", R.OUT_OF_MEMORY)


def test_a_check_that_errors_fails_closed():
    # one injected fault: the facts fail, reported once where they are read; every check
    # that needs them fails closed with CHECK_ERROR without reporting it again
    rs = run({0: {"facts_error": RuntimeError("nvml exploded")}}, internal_errors=("rank_facts",))
    for r in rs:
        # a check that needs the facts (the first on the rank that decided; the register names it)
        assert r["check"] in ("capture", "packages", "multicast"), r
        assert r["outcome"] == "vetoed" and r["calls"] == 0, r
        assert R.REASON_TEXT[R.CHECK_ERROR] in r["err"] and "nvml exploded" in r["err"], r
        assert _carries(r, R.CHECK_ERROR), r
        assert "Traceback" not in r["err"]
    assert any("CHECK_ERROR" in (r["reasons"] or []) for r in rs), rs


def test_package_versions_read_cheaply_match_the_metadata():
    """The packages check reads the versions from the ``.dist-info`` folders (no scan of
    every path entry); they are the ones ``importlib.metadata`` reports."""
    from importlib import metadata

    from flashinfer_safe_workspace.planning import rankfacts

    for name, version in rankfacts.packages():
        try:
            expected = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = ""
        assert version == expected, name
    assert dict(rankfacts.packages())["flashinfer-python"]  # installed for the tests


def named_in(cell):  # the tests a cell of the table names
    import re
    return re.findall(r"`((?:tests/[\w/]+\.py::)?test_\w+)", cell)


def test_failure_modes_doc_names_tests_that_exist():
    """Every mode row of docs/failure-modes.md names its fast tests (``tests/unit``) and a
    real-rank test, and each named test exists (a bare name in this file,
    ``tests/x.py::name`` elsewhere)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = [l for l in (root / "docs/failure-modes.md").read_text().splitlines()
            if re.match(r"^\| (\d+b?|-) \|", l)]
    modes = {l.split("|")[1].strip() for l in rows}
    assert {str(n) for n in range(1, 13)} <= modes
    for row in rows:
        fast, real = row.split("|")[-3:-1]  # both kinds of proof: fast layer, real ranks
        named = re.findall(r"`((?:tests/[\w/]+\.py::)?test_\w+)(?:\[[^\]]*\])?`", fast + real)
        assert "`tests/unit/" in fast and real.strip() and any(not n.startswith("tests/unit/") for n in named_in(real)), row
        for ref in named:
            path, _, name = ref.rpartition("::")
            text = (root / (path or "tests/ranks/test_checks.py")).read_text()
            assert f"def {name}(" in text, ref


def _ctx(settings=None, **sim):
    from flashinfer_safe_workspace import _config, checks
    from flashinfer_safe_workspace.agreement.group import Members
    from flashinfer_safe_workspace.planning.plan import Request
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    req = Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16")
    return checks.Context(req, "0.7.4", checks.traits_for("0.7.4"),
                          Members("local", (0, 1), 0, "test"), settings or _config.current(),
                          {}, SimulatedDevice(80 << 30, **sim).rank_facts())


@pytest.mark.internal_errors("check.capture")
def test_a_check_with_a_bug_fails_closed_with_its_own_reason(monkeypatch):
    """A check that raises (a bug, not missing facts) is a no with CHECK_ERROR naming the
    check, reported once as an internal error at its own site; FAIL_OPEN turns it into a yes
    (still CHECK_ERROR, so the decision line says why)."""
    from flashinfer_safe_workspace import _config, checks
    from flashinfer_safe_workspace.checks import capture

    def broken(ctx):
        raise ValueError("a bug in the capture check")

    monkeypatch.setattr(capture, "local", broken)
    results = checks.run_local(_ctx())
    res = results["capture"]
    assert (res.ok, res.code, res.value) == (False, R.CHECK_ERROR, "check=capture")
    assert "ValueError: a bug in the capture check" in res.note
    assert checks.first_failure(results)[0] == "capture"
    assert all(r.ok for n, r in results.items() if n != "capture")  # the others still ran
    opened = checks.run_local(_ctx(_config.reload(fail_open=True)))["capture"]
    assert opened.ok and opened.code == R.CHECK_ERROR


def test_a_comparison_that_errors_fails_closed(monkeypatch):
    """A cross-rank comparison that raises is a Failure with CHECK_ERROR for that check
    (pure: every rank computes it from the same records); the other comparisons still run."""
    from flashinfer_safe_workspace import checks
    from flashinfer_safe_workspace.checks import packages

    def broken(records):
        raise KeyError("field")

    monkeypatch.setattr(packages, "compare", broken)
    failures = checks.compare([])
    assert [(f.check, f.code) for f in failures] == [("packages", R.CHECK_ERROR)]
    assert "comparison failed: KeyError" in failures[0].text
