"""The checks' shared vocabulary (``checks/base.py``, ``checks/__init__.py``): which
allocator and handle type a release's path uses, whether it makes a multicast object,
and how a check's answer is run, reported and compared. Pure functions over facts."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.agreement.record import CheckResult
from flashinfer_safe_workspace.checks import base, capture, packages
from unit.facts import CLUSTER, ctx, fabric, record, with_check


# (version, backend, entry, use_symm_dev_mem, cc) -> allocator; one row per range and path
ALLOCATORS = [
    ("0.5.0", "trtllm", "legacy", False, False, "A"),
    ("0.5.0", "trtllm", "legacy", True, False, "A"),  # no use_symm_dev_mem before 0.6
    ("0.6.0", "trtllm", "unified", False, False, "B1"),
    ("0.6.0", "trtllm", "legacy", True, False, "B1"),
    ("0.6.9", "trtllm", "legacy", False, False, "A"),
    ("0.6.10", "trtllm", "legacy", False, False, "C"),
    ("0.6.10", "mnnvl", "unified", False, False, "C"),
    ("0.6.14", "auto", "unified", False, False, "C"),
    ("0.6.15", "trtllm", "unified", False, False, "B2"),
    ("0.6.16", "trtllm", "unified", False, False, "B3"),
    ("0.6.16", "trtllm", "unified", False, True, "C"),  # confidential computing: torch symm
    ("0.6.15", "trtllm", "unified", False, True, "B2"),  # before 0.6.16 CC is not consulted
    ("0.6.16", "mnnvl", "unified", False, True, "B3"),  # only trtllm switches under CC
    ("0.7.2.post1", "mnnvl-cutedsl", "unified", False, False, "D"),
    ("0.7.4", "trtllm", "unified", False, False, "B4"),
    ("0.7.4", "auto", "unified", False, False, "B4"),
]


@pytest.mark.parametrize("version,backend,entry,symm,cc,expected", ALLOCATORS)
def test_allocator_of_each_range_and_path(version, backend, entry, symm, cc, expected):
    assert ctx(backend, version, entry=entry, symm=symm, cc=cc).allocator == expected


def test_allocator_unknown_without_traits():
    c = ctx("trtllm", "0.4.0")  # older than every rule: no traits
    assert c.traits is None and c.allocator == ""
    assert checks.traits_for("") is None and checks.traits_for("garbage") is None
    assert checks.traits_for("0.7.4").label == "R10"


MULTICAST = [  # (version, backend, entry) -> makes a multicast object whatever the peers say
    ("0.6.0", "mnnvl", "unified", True),
    ("0.7.4", "mnnvl", "unified", True),
    ("0.7.2.post1", "mnnvl-cutedsl", "unified", True),
    ("0.6.15", "auto", "unified", True),  # auto before 0.6.16 is always mnnvl
    ("0.6.16", "auto", "unified", False),  # 0.6.16+: auto votes on multicast itself
    ("0.7.4", "auto", "unified", False),
    ("0.7.4", "trtllm", "unified", False),
    ("0.6.10", "trtllm", "legacy", False),
    ("0.4.0", "mnnvl", "unified", False),  # no traits: nothing known
]


@pytest.mark.parametrize("version,backend,entry,expected", MULTICAST)
def test_makes_multicast(version, backend, entry, expected):
    assert ctx(backend, version, entry=entry).makes_multicast is expected


HANDLES = [  # (version, backend, fabric handles, NVML fabric) -> FlashInfer's handle
    ("0.6.9", "trtllm", "legacy", False, None, "cudaipc"),
    ("0.6.10", "trtllm", "unified", True, fabric(), "torch"),
    ("0.7.2.post1", "mnnvl-cutedsl", "unified", True, fabric(), "torch"),
    ("0.7.4", "trtllm", "unified", True, fabric(), "vote"),
    ("0.7.2", "trtllm", "unified", True, fabric(), "fabric"),
    ("0.7.2", "trtllm", "unified", False, fabric(), "posix"),  # driver: no FABRIC handles
    ("0.7.2", "trtllm", "unified", True, None, "posix"),  # no NVML fabric info
    ("0.7.2", "trtllm", "unified", True, fabric(cluster="0" * 32), "posix"),  # no cluster
    ("0.7.2", "trtllm", "unified", True, fabric(state=2), "posix"),  # still forming
    ("0.7.2", "trtllm", "unified", True, fabric(status=5), "fabric"),  # FlashInfer ignores status
]


@pytest.mark.parametrize("version,backend,entry,fh,fab,expected", HANDLES)
def test_handle_of(version, backend, entry, fh, fab, expected):
    assert base.handle_of(ctx(backend, version, entry=entry, fabric_handles=fh,
                              fabric=fab)) == expected


def test_facts_unavailable_carries_the_readers_error():
    c = ctx(facts=False)
    with pytest.raises(checks.FactsUnavailable, match="^this rank's facts could not be read$"):
        c.facts()
    c.extra["facts_error"] = "NVML said no"
    with pytest.raises(checks.FactsUnavailable, match="^NVML said no$"):
        c.facts()
    assert ctx().backend == "trtllm"


def test_fields_ok_fail_and_grouping():
    assert base.fields("a=1 b=x c") == {"a": "1", "b": "x", "c": ""}
    assert base.fields("") == {}
    assert base.ok() == CheckResult(True, R.OK, "", "")
    assert base.ok("v=1", "n") == CheckResult(True, R.OK, "v=1", "n")
    long = base.fail(R.NO_IMEX, "v", "x" * 400)
    assert (long.ok, long.code, long.value, len(long.note)) == (False, R.NO_IMEX, "v", 300)
    assert base.fail(R.NO_IMEX, "v", "short").note == "short"
    pairs = [(0, CheckResult(value="a=1")), (1, CheckResult(value="a=2")),
             (2, CheckResult(value="a=1")), (3, CheckResult(value="b=1"))]
    assert base.group_by(pairs, base.by_field("a")) == (
        ("a=1", (0, 2)), ("a=2", (1,)), ("a=?", (3,)))
    assert base.group_by(pairs, base.whole_value) == (
        ("a=1", (0, 2)), ("a=2", (1,)), ("b=1", (3,)))
    assert base.every_release(ctx()) is True


def test_applying_skips_records_where_the_check_did_not_apply():
    recs = [record(0, checks_=with_check("x", "v=1")),
            record(1, checks_=with_check("x", "v=2", applies=False)),
            record(2), record(3, checks_=with_check("x", "v=3"))]
    assert [p for p, _ in base.applying(recs, "x")] == [0, 3]
    assert base.differ(recs, "x", base.whole_value, 7, "t") == base.Failure(
        "x", 7, "t", (("v=1", (0,)), ("v=3", (3,))))
    assert base.differ(recs[:3], "x", base.whole_value, 7, "t") is None


def test_run_one_reports_not_applying_and_failing_closed(monkeypatch):
    not_here = checks.run_one(packages, ctx())
    assert not_here.applies is True  # packages applies on every release
    monkeypatch.setattr(capture, "applies", lambda c: False)
    skipped = checks.run_one(capture, ctx(capturing=True))
    assert skipped == CheckResult(True, R.OK, "", "", applies=False)


def test_unreadable_facts_fail_closed_without_an_internal_error():
    res = checks.run_one(capture, ctx(facts=False))  # strict mode: no internal error here
    assert (res.ok, res.code, res.value) == (False, R.CHECK_ERROR, "check=capture")
    assert res.note.startswith("FactsUnavailable: ")
    from unit.facts import settings
    opened = checks.run_one(capture, ctx(facts=False, sett=settings(fail_open=True)))
    assert (opened.ok, opened.code) == (True, R.CHECK_ERROR)


def test_run_local_runs_every_local_check_in_order():
    results = checks.run_local(ctx())
    assert list(results) == [c.NAME for c in checks.LOCAL]
    assert list(results) == ["group", "capture", "packages", "device", "gpus", "multicast",
                             "fabric", "hosts", "handles"]
    assert checks.first_failure(results) is None
    bad = checks.run_local(ctx(capturing=True, multicast=False, backend="mnnvl"))
    assert checks.first_failure(bad) == ("capture", bad["capture"])
    assert [c.NAME for c in checks.CROSS] == ["packages", "gpus", "multicast", "hosts",
                                              "handles"]
    assert [c.NAME for c in checks.ALL] == [c.NAME for c in checks.LOCAL] + ["deep", "memory"]


def test_named_in_reads_the_check_from_a_veto_text():
    assert checks.named_in("rank 1: check hosts: the ranks span") == "hosts"
    assert checks.named_in("check mnnvl-x: y") == "mnnvl-x"
    assert checks.named_in("no check here") == ""
    assert checks.named_in(None) == ""


def test_every_check_declares_its_name_code_modes_and_releases():
    codes = {c.NAME: c.CODE for c in checks.ALL}
    assert codes == {"group": R.RENDEZVOUS_GROUP, "capture": R.CAPTURING,
                     "packages": R.PACKAGE_MISMATCH, "device": R.DEVICE_MISMATCH,
                     "gpus": R.SHARED_GPU, "multicast": R.NO_MULTICAST,
                     "fabric": R.FABRIC_NOT_READY, "hosts": R.HOSTS_SPAN,
                     "handles": R.HANDLE_MISMATCH, "deep": R.DEEP_PROBE_FAILED,
                     "memory": R.OUT_OF_MEMORY}
    for check in checks.ALL:
        assert check.MODES and check.RELEASES, check.NAME


@pytest.mark.internal_errors("check.capture")
def test_a_check_with_a_bug_fails_closed_and_reports_once(monkeypatch):
    """A bug (not missing facts) is reported as an internal error at the check's own site;
    settings without ``fail_open`` fail closed; the note is cut to 300 characters."""
    import types

    def broken(c):
        raise ValueError("b" * 400)

    monkeypatch.setattr(capture, "local", broken)
    res = checks.run_one(capture, ctx(sett=types.SimpleNamespace()))
    assert (res.ok, res.code, res.value) == (False, R.CHECK_ERROR, "check=capture")
    assert res.note == ("ValueError: " + "b" * 400)[:300]


def test_a_comparison_that_raises_fails_closed_for_that_check(monkeypatch):
    from flashinfer_safe_workspace.checks import hosts

    def broken(records):
        raise KeyError("k" * 300)

    monkeypatch.setattr(hosts, "compare", broken)
    failures = checks.compare([record(0)])
    assert [(f.check, f.code, f.by_value) for f in failures] == [("hosts", R.CHECK_ERROR, ())]
    assert failures[0].text == ("comparison failed: KeyError: '" + "k" * 300)[:200]
