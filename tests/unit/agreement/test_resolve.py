"""``agreement/vote.resolve``: the group's answer from every rank's record, as a pure
function (the same on every rank). Each row is one way a round can end; the verdict's
fields are asserted whole, so a branch that answers the right yes/no for the wrong reason
fails too."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _decide  # noqa: F401 - registers checks.compare (vote.use_comparison)
from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace.agreement import vote
from flashinfer_safe_workspace.agreement.record import NO, PASS, PASS_STATE, YES, Candidate
from flashinfer_safe_workspace.agreement.vote import Verdict, resolve
from unit.facts import record, with_check


def yes(digest="d"):
    return Candidate(YES, plan_digest=digest)


def test_every_rank_yes_with_one_plan_commits():
    assert resolve([record(0), record(1), record(2)]) == Verdict(True, "every rank voted yes", "-")


def test_a_single_no_vetoes_and_names_its_check():
    rs = [record(0), record(1, state=NO, reason=R.NO_MULTICAST,
                             checks_=with_check("multicast", "multicast=0", ok=False,
                                                code=R.NO_MULTICAST)), record(2)]
    assert resolve(rs) == Verdict(False, "a rank said no", "-", no=(1,), check="multicast")


def test_the_first_no_rank_naming_a_check_decides_the_name():
    rs = [record(0, state=NO), record(1, state=NO, checks_=with_check("fabric", "f", ok=False)),
          record(2, state=NO, checks_=with_check("hosts", "h", ok=False))]
    v = resolve(rs)
    assert (v.commit, v.no, v.check) == (False, (0, 1, 2), "fabric")


def test_a_no_without_a_failing_check_names_none():
    v = resolve([record(0, state=NO, checks_=with_check("capture", "capturing=0")), record(1)])
    assert (v.why, v.no, v.check) == ("a rank said no", (0,), "")


def test_malformed_records_veto():
    assert resolve([record(0), None, "x"]) == Verdict(False, "malformed records from positions [1, 2]")


def test_different_calls_veto_with_the_differing_arguments():
    rs = [record(0, call="a", args={"n": 1, "dtype": "bf16"}),
          record(1, call="b", args={"n": 2, "dtype": "bf16"}),
          record(2, call="a", args={"n": 1, "dtype": "bf16", "extra": 3})]
    v = resolve(rs)
    assert (v.commit, v.why) == (False, "ranks called with different arguments")
    assert v.mismatch == (("extra", {"None": [0, 1], "3": [2]}), ("n", {"1": [0, 2], "2": [1]}))
    assert (v.no, v.check, v.candidate) == ((), "", "")


def test_all_pass_is_flashinfers_own_error_on_every_rank():
    rs = [record(0, state=PASS_STATE), record(1, state=PASS_STATE)]
    assert resolve(rs) == Verdict(False, "FlashInfer rejects these arguments on every rank", "-",
                                  passing=(0, 1), all_pass=True)


def test_pass_on_some_ranks_only_vetoes():
    v = resolve([record(0, state=PASS_STATE), record(1)])
    assert v == Verdict(False, "FlashInfer rejects the arguments on some ranks only", "-",
                        passing=(0,))


def test_a_no_outranks_a_pass_in_the_reason():
    v = resolve([record(0, state=PASS_STATE), record(1, state=NO)])
    assert (v.why, v.no, v.passing, v.all_pass) == ("a rank said no", (1,), (0,), False)


def test_plans_that_differ_while_every_check_passes_veto():
    rs = [record(0, digest="x"), record(1, digest="y"), record(2, digest="y")]
    assert resolve(rs) == Verdict(False, "plans differ between ranks", "-", plan_mismatch=(0,))
    rs = [record(0, digest="x"), record(1, digest="x"), record(2, digest="y"), record(3, digest="z")]
    assert resolve(rs).plan_mismatch == (2, 3)


def test_a_cross_rank_check_vetoes_an_all_yes_group():
    rs = [record(0, checks_=with_check("packages", "python=0.7.4")),
          record(1, checks_=with_check("packages", "python=0.7.2"))]
    v = resolve(rs)
    assert (v.commit, v.why, v.check, v.no) == (False, "a check across ranks failed", "packages", ())
    assert [(f.check, f.code) for f in v.checks] == [("packages", R.PACKAGE_MISMATCH)]


def test_a_cross_check_names_the_veto_before_a_no_rank():
    rs = [record(0, state=NO, checks_={**with_check("capture", "c", ok=False),
                                       **with_check("handles", "handle=posix")}),
          record(1, checks_=with_check("handles", "handle=fabric"))]
    v = resolve(rs)
    assert (v.why, v.check, v.no) == ("a rank said no", "handles", (0,))


def test_a_missing_candidate_is_a_no():
    v = resolve([record(0), record(1, cands={"other": yes()})])
    assert (v.commit, v.no) == (False, (1,))


# ---------------------------------------------------------------- auto: the AND over candidates
def auto(pos, multicast, **cands):
    return record(pos, auto=True, multicast=multicast, cands=cands)


AUTO = [
    # every rank has multicast: the group takes "mc", and each rank's mc must be a yes
    ([auto(0, True, nomc=yes(), mc=yes("m")), auto(1, True, nomc=yes(), mc=yes("m"))],
     Verdict(True, "every rank voted yes", "mc")),
    # a rank that can afford trtllm but not mnnvl beside one that can afford both: veto
    ([auto(0, True, nomc=yes(), mc=yes("m")), auto(1, True, nomc=yes(), mc=Candidate(NO, R.OUT_OF_MEMORY))],
     Verdict(False, "a rank said no", "mc", no=(1,))),
    ([auto(0, True, nomc=yes(), mc=Candidate(NO)), auto(1, True, nomc=yes(), mc=Candidate(NO))],
     Verdict(False, "a rank said no", "mc", no=(0, 1))),
    # one rank without multicast: the group takes "nomc", whatever mc says elsewhere
    ([auto(0, True, nomc=yes(), mc=Candidate(NO)), auto(1, False, nomc=yes())],
     Verdict(True, "every rank voted yes", "nomc")),
    ([auto(0, True, nomc=Candidate(NO), mc=yes()), auto(1, False, nomc=yes())],
     Verdict(False, "a rank said no", "nomc", no=(0,))),
    # the plans of the chosen candidate must agree
    ([auto(0, True, nomc=yes("a"), mc=yes("m1")), auto(1, True, nomc=yes("a"), mc=yes("m2")),
      auto(2, True, nomc=yes("a"), mc=yes("m2"))],
     Verdict(False, "plans differ between ranks", "mc", plan_mismatch=(0,))),
]


@pytest.mark.parametrize("records,expected", AUTO, ids=[
    "all-mc-yes", "one-rank-short-for-mc", "all-short-for-mc", "nomc-chosen",
    "nomc-short", "mc-plans-differ"])
def test_auto_resolves_one_candidate_for_the_group(records, expected):
    assert all(r.is_yes() for r in records if any(c.state == YES for c in r.candidates.values()))
    assert resolve(records) == expected


# ---------------------------------------------------------------- helpers
def test_digest_and_members_key():
    from pathlib import PurePosixPath

    assert vote.digest({"b": 1, "a": 2}) == vote.digest({"a": 2, "b": 1})
    assert vote.digest([PurePosixPath("x")]) == vote.digest(["x"])  # any value, as text
    assert len(vote.digest([1])) == 16 and vote.digest([1]) != vote.digest([2])
    assert vote.members_key((0, 1, 2)) == "0-1-2"
    assert vote.members_key(tuple(range(32))) == "-".join(map(str, range(32)))
    many = tuple(range(33))
    assert vote.members_key(many) == f"33x{vote.digest(list(many))}"


def test_a_local_round_resolves_its_one_record():
    rnd = vote.LocalRound("solo")
    assert (rnd.label, rnd.decided, rnd.open(), rnd.abort_now("x")) == ("solo", None, None, None)
    assert vote.LocalRound().label == "local"
    out = rnd.vote(record(0))
    assert (out.commit, out.register, out.records) == (True, None, [record(0)])
    assert out.verdict == Verdict(True, "every rank voted yes", "-")
    no = rnd.vote(record(0, state=NO))
    assert (no.commit, no.register) == (False, None)
    passing = rnd.vote(record(0, state=PASS_STATE))
    assert (passing.commit, passing.register.outcome) == (False, PASS)


def test_a_local_round_times_its_vote(monkeypatch):
    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(vote, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(ticks))}))
    assert vote.LocalRound().vote(record(0)).elapsed_s == 2.5


# ---------------------------------------------------------------- the handed-in comparison
@pytest.mark.internal_errors("vote.compare")
def test_no_comparison_handed_in_fails_closed_as_an_internal_error(monkeypatch, _strict):
    monkeypatch.setattr(vote, "_comparison", None)
    assert resolve([record(0), record(1)]) == Verdict(
        False, f"internal error: {vote.NO_COMPARISON}", internal=True)
    assert _strict == [("vote.compare", f"RuntimeError: {vote.NO_COMPARISON}")]


@pytest.mark.internal_errors("vote.compare")
def test_a_comparison_that_raises_fails_closed_as_an_internal_error(monkeypatch, _strict):
    def broken(records):
        raise ValueError("bug")

    monkeypatch.setattr(vote, "_comparison", broken)
    assert resolve([record(0), record(1)]) == Verdict(
        False, "internal error: the cross-rank comparison failed", internal=True)
    assert _strict == [("vote.compare", "ValueError: bug")]


def test_use_comparison_takes_a_callable_only(monkeypatch):
    monkeypatch.setattr(vote, "_comparison", vote._comparison)  # restored after the test
    seen = []

    def compare(records):
        seen.append(len(records))
        return []

    vote.use_comparison(compare)
    assert vote._comparison is compare
    assert resolve([record(0), record(1)]).commit and seen == [2]
    with pytest.raises(TypeError, match=r"^use_comparison needs a callable, not int$"):
        vote.use_comparison(3)
    assert vote._comparison is compare
