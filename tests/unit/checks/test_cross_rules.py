"""Every cross-rank comparison (``compare(records)``) alone, over records built by hand:
ranks that agree pass, ranks that differ fail with the check's name, code and who holds
which value, and records where the check did not apply are left out. Each comparison is
also run through ``checks.compare`` (the list the vote uses) so that removing it from
``CROSS`` fails here even though the local half of the same check still vetoes."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.checks import gpus, handles, hosts, multicast, packages
from flashinfer_safe_workspace.checks.base import Failure
from unit.facts import CLUSTER, record, with_check


def recs(name, *values, applies=None):
    """One record per value, each with check ``name`` holding that value."""
    applies = applies or [True] * len(values)
    return [record(i, checks_=with_check(name, v, applies=a))
            for i, (v, a) in enumerate(zip(values, applies))]


def only(records):
    """``checks.compare``'s failures as (check, code, by_value)."""
    return [(f.check, f.code, f.by_value) for f in checks.compare(records)]


# ----------------------------------------------------------------- mode 2b: gpus
def test_mode2b_two_ranks_on_one_gpu():
    rs = recs("gpus", "gpu=h|A", "gpu=h|B", "gpu=h|A", "gpu=h|C", "gpu=h|C")
    f = gpus.compare(rs)
    assert (f.check, f.code) == ("gpus", R.SHARED_GPU)
    assert f.by_value == (("gpu=h|A", (0, 2)), ("gpu=h|C", (3, 4)))
    assert only(rs) == [("gpus", R.SHARED_GPU, f.by_value)]
    assert f.text == "ranks share a GPU on a path that adds one device per rank to a multicast object"


def test_mode2b_distinct_gpus_or_not_applying_pass():
    assert gpus.compare(recs("gpus", "gpu=h|A", "gpu=h|B")) is None
    assert gpus.compare(recs("gpus", "gpu=h|A", "gpu=h|A", applies=[True, False])) is None
    assert gpus.compare([record(0), record(1)]) is None  # trtllm: the check did not run
    assert only(recs("gpus", "gpu=h|A", "gpu=h|B")) == []


# ----------------------------------------------------------------- mode 4: multicast / cc
def test_mode4_ranks_disagree_on_confidential_compute():
    rs = recs("multicast", "multicast=1 cc=0", "multicast=0 cc=1", "multicast=0 cc=0")
    f = multicast.compare(rs)
    assert f == Failure("multicast", R.CONFIDENTIAL_COMPUTE, f.text,
                        (("cc=0", (0, 2)), ("cc=1", (1,))))
    assert f.text == ("ranks disagree on confidential computing (FlashInfer would pick different "
                      "allocators)")
    assert only(rs) == [("multicast", R.CONFIDENTIAL_COMPUTE, f.by_value)]


def test_mode4_multicast_alone_differing_is_not_a_cross_failure():
    # multicast support differing is auto's own vote (0.6.16+), not a cross-rank failure
    assert multicast.compare(recs("multicast", "multicast=1 cc=1", "multicast=0 cc=1")) is None
    assert multicast.compare(recs("multicast", "multicast=1 cc=0", "multicast=1 cc=1",
                                  applies=[True, False])) is None


# ----------------------------------------------------------------- mode 6: hosts
HOSTS = [  # values per rank -> failure's by_value, or None
    (["host=a handle=posix cluster=-", "host=a handle=posix cluster=-"], None),
    (["host=a handle=posix cluster=-", "host=b handle=posix cluster=-"],
     (("host=a", (0,)), ("host=b", (1,)))),
    (["host=a handle=cudaipc cluster=-", "host=b handle=cudaipc cluster=-", "host=a handle=cudaipc cluster=-"],
     (("host=a", (0, 2)), ("host=b", (1,)))),
    ([f"host=a handle=fabric cluster={CLUSTER}", f"host=b handle=fabric cluster={CLUSTER}"], None),
    ([f"host=a handle=fabric cluster={CLUSTER}", "host=b handle=fabric cluster=cd"],
     (("host=a", (0,)), ("host=b", (1,)))),
    (["host=a handle=fabric cluster=-", "host=b handle=fabric cluster=-"],
     (("host=a", (0,)), ("host=b", (1,)))),
    ([f"host=a handle=fabric cluster={CLUSTER}", f"host=b handle=posix cluster={CLUSTER}"],
     (("host=a", (0,)), ("host=b", (1,)))),
    (["host=a handle=torch cluster=-", "host=b handle=torch cluster=-"],
     (("host=a", (0,)), ("host=b", (1,)))),
]


@pytest.mark.parametrize("values,expected", HOSTS)
def test_mode6_ranks_span_hosts(values, expected):
    rs = recs("hosts", *values)
    f = hosts.compare(rs)
    if expected is None:
        assert f is None
        assert only(rs) == []
    else:
        assert (f.check, f.code, f.by_value) == ("hosts", R.HOSTS_SPAN, expected)
        assert f.text == (f"the ranks span {len(expected)} hosts but the transport is single-host "
                          "(no FABRIC handles in one NVLink domain)")
        assert ("hosts", R.HOSTS_SPAN, expected) in only(rs)


def test_mode6_exempt_ranks_do_not_count():
    rs = recs("hosts", "host=a handle=posix cluster=-", "host=b handle=posix cluster=-",
              applies=[True, False])
    assert hosts.compare(rs) is None
    # the fabric exemption reads only the ranks the check applied on
    rs = recs("hosts", f"host=a handle=fabric cluster={CLUSTER}",
              f"host=b handle=fabric cluster={CLUSTER}", "host=c handle=posix cluster=-",
              applies=[True, True, False])
    assert hosts.compare(rs) is None


# ----------------------------------------------------------------- mode 7: handles
def test_mode7_handle_types_differ():
    rs = recs("handles", "handle=fabric imex=1", "handle=posix imex=1", "handle=posix imex=0")
    f = handles.compare(rs)
    assert (f.check, f.code, f.by_value) == ("handles", R.HANDLE_MISMATCH,
                                             (("handle=fabric", (0,)), ("handle=posix", (1, 2))))
    assert f.text == "ranks would choose different handle types (different exchanges: a hang)"
    assert ("handles", R.HANDLE_MISMATCH, f.by_value) in only(rs)


def test_mode7_same_handle_or_not_applying_pass():
    assert handles.compare(recs("handles", "handle=posix imex=1", "handle=posix imex=0")) is None
    assert handles.compare(recs("handles", "handle=fabric imex=1", "handle=posix imex=1",
                                applies=[False, True])) is None


# ----------------------------------------------------------------- mode 11: packages
def test_mode11_packages_differ_between_ranks():
    # each rank's own packages match: only the comparison can see the skew
    rs = recs("packages", "python=0.7.4 cubin=- jit=-", "python=0.7.2 cubin=- jit=-")
    f = packages.compare(rs)
    assert (f.check, f.code, f.by_value) == (
        "packages", R.PACKAGE_MISMATCH,
        (("python=0.7.4 cubin=- jit=-", (0,)), ("python=0.7.2 cubin=- jit=-", (1,))))
    assert f.text == "FlashInfer packages differ between ranks"
    assert only(rs) == [("packages", R.PACKAGE_MISMATCH, f.by_value)]


def test_mode11_same_packages_pass():
    assert packages.compare(recs("packages", "python=0.7.4 cubin=- jit=-",
                                 "python=0.7.4 cubin=- jit=-")) is None


def test_compare_lists_every_failing_check_in_cross_order():
    rs = [record(0, checks_={**with_check("packages", "p=1"), **with_check("gpus", "g"),
                             **with_check("hosts", "host=a handle=posix cluster=-"),
                             **with_check("handles", "handle=posix")}),
          record(1, checks_={**with_check("packages", "p=2"), **with_check("gpus", "g"),
                             **with_check("hosts", "host=b handle=posix cluster=-"),
                             **with_check("handles", "handle=fabric")})]
    assert [f[0] for f in only(rs)] == ["packages", "gpus", "hosts", "handles"]
