"""Every interleaving of the agreement's core, small: 2 and 3 ranks, up to 3 calls per
rank, one fault class at a time (tests/model/scenarios.py), explored breadth-first by
tests/model/checker.py over the package's own ``agreement.core.Core``.

The state counts are pinned: a change of the core or of the model that makes the search
reach more or fewer states fails here, and must be looked at (and the counts updated in
the same commit, with why). Each scenario also names what it must be able to reach
(*sometimes*), and together they reach every outcome, so no branch is skipped silently.
"""

from __future__ import annotations

import dataclasses

import pytest

from flashinfer_safe_workspace.agreement import core as C
from model import checker as K
from model import scenarios as SC
from model import system as S

# scenario name -> (states visited, final states, what it must reach)
PINNED = {
    "two ranks: every rank says yes, three calls": (215, 1, {"commit"}),
    "two ranks: a no, then two clean calls": (339, 2, {"commit", "abort by no"}),
    "two ranks: mismatched arguments, then two clean calls": (297, 1, {"commit", "abort by mismatch"}),
    "two ranks: rank 0 calls 1000 then 1024, rank 1 calls 1024 then 1024": (
        183, 1, {"commit", "abort by mismatch"}),
    "two ranks: rank 0 makes one call more than rank 1": (
        223, 1, {"commit", "abort by mismatch", "abort by timeout"}),
    "two ranks: rank 1 arrives after rank 0's deadline": (
        79, 1, {"commit", "abort by timeout", "a late rank follows a decided register"}),
    "two ranks: either crashes at any step": (1563, 79, {"commit", "abort by timeout"}),
    "two ranks: either is paused past the vote timeout": (
        2993, 19, {"commit", "abort by timeout", "a late rank follows a decided register"}),
    "two ranks: rank 1 arrives at rank 0's deadline, and either is paused (its requests sent "
    "or not)": (2998, 33, {"commit", "abort by timeout", "a late rank follows a decided register"}),
    "two ranks: either is interrupted (Ctrl-C) mid-round": (
        1673, 85, {"commit", "abort by an interrupt", "abort by timeout"}),
    "two ranks: the store stops for less than the grace, or past every deadline": (
        13179, 70, {"commit", "abort by timeout", "in doubt"}),
    "two ranks: rank 1 arrives at rank 0's deadline, and the store stops past it": (
        634, 41, {"commit", "abort by timeout", "a late rank follows a decided register"}),
    "two ranks: rank 0 answers its first call from its veto cache": (
        321, 2, {"commit", "abort by a peer's cached veto"}),
    "two ranks: a new group on the same store after a round only rank 0 made": (
        212, 1, {"commit", "abort by timeout"}),
    "two ranks: a new group on the same store after a no, with a no": (
        389, 4, {"commit", "abort by no"}),
    "two ranks: new processes form a new group on the same store after a round only rank 0 made": (
        207, 1, {"commit", "abort by timeout"}),
    "two ranks: an outsider reads a missing register (a spurious wake-up)": (316, 2, {"commit"}),
    "three ranks: every rank says yes, three calls": (4507, 1, {"commit"}),
    "three ranks: a no and a mismatch, then two clean calls": (20142, 4, {"commit", "abort by no"}),
    "three ranks: rank 2 arrives after the others' deadlines": (
        337, 1, {"commit", "abort by timeout", "a late rank follows a decided register"}),
    "three ranks: any one crashes at any step": (3453, 157, {"commit", "abort by timeout"}),
    "three ranks: any one is paused past the vote timeout": (7188, 10, {"commit", "abort by timeout"}),
    "three ranks: the store stops for less than the grace, or past every deadline": (
        16019, 44, {"commit", "in doubt"}),
    "three ranks: rank 0 makes one call more, rank 1 answers from its cache": (
        1882, 32, {"abort by timeout", "abort by a peer's cached veto",
               "a late rank follows a decided register"}),
}


def test_every_scenario_is_pinned():
    assert [sc.name for sc in SC.SCENARIOS] == list(PINNED)


@pytest.mark.parametrize("sc", SC.SCENARIOS, ids=[sc.name for sc in SC.SCENARIOS])
def test_every_interleaving_keeps_the_promise(sc):
    res = K.explore(sc)
    assert res.violations == [], res.violations[0]
    states, finals, reach = PINNED[sc.name]
    assert (res.states, res.finals) == (states, finals)
    assert reach <= res.seen, f"never reached: {reach - res.seen}"


def test_together_the_scenarios_reach_every_outcome():
    seen = set()
    for sc in SC.SCENARIOS:
        seen |= PINNED[sc.name][2]
    assert seen == set(K.SOMETIMES)


# -- the checker is not vacuous: a core broken in each of the ways that matter fails it


def _violated(sc) -> str:
    res = K.explore(sc)
    assert res.violations, "the broken core passed"
    return res.violations[0][0]


def test_a_commit_before_every_yes_is_in_is_caught(monkeypatch):
    def counted(self, c):  # decides one arrival early
        if int(c) >= self.setup.size - 1:
            return self._to(C.READ), [C.Op("get", self.setup.key("r"), tag=C.T_READ)]
        return self._to(C.WAIT), [C.Op("wait", self.setup.key("d"), tag=C.T_WAIT, line="wait")]
    monkeypatch.setitem(C._HANDLERS, (C.COUNT, C.T_COUNT), counted)
    assert _violated(SC.TWO[1]).split(" ")[0] in ("valid", "agreement")


def test_a_commit_over_different_calls_is_caught(monkeypatch):
    def read(self, blob):  # no comparison of the calls
        return self._write(self.setup.codec.verdict([]))
    monkeypatch.setitem(C._HANDLERS, (C.READ, C.T_READ), read)
    assert _violated(SC.TWO[3]).startswith("valid")


def test_a_register_that_is_not_followed_is_caught(monkeypatch):
    def decided(self, held):  # a rank answers with what it wrote, not what the register holds
        return C.Core._decided(self, self.proposed[-1] if self.proposed else held)
    monkeypatch.setitem(C._HANDLERS, (C.WRITE, C.T_WRITE), decided)
    assert _violated(SC.TWO[5]).startswith(("agreement", "clean rounds"))


def test_a_deadline_that_never_fires_is_caught(monkeypatch):
    monkeypatch.setattr(C.Core, "on_tick", lambda self, now: (self, []))
    assert _violated(SC.TWO[4]).startswith(("terminates", "bounded"))


def _named(part):
    return next(sc for sc in SC.SCENARIOS if part in sc.name)


def test_a_grace_that_counts_the_time_the_rank_was_stopped_is_caught(monkeypatch):
    """Issue 29's review (F1): a rank stopped at its deadline with its abort not sent, its
    peer committing meanwhile; on resuming, its tick came before the abort's reply and it
    was in doubt beside its peer's creation. The model's "held" pause finds it."""
    monkeypatch.setattr(C.Core, "on_resume", lambda self, now, lost: (self, []))
    assert _violated(_named("and either is paused")).startswith("doubt only when the store")


def test_doubt_after_the_register_was_read_is_caught(monkeypatch):
    right = C.Core.on_tick

    def on_tick(self, now):  # past the grace: doubt, whatever it read meanwhile
        if self.answer is None and self.aborting and now >= self.abort_at + self.setup.grace:
            return self._to(C.DONE, answer=C.DOUBT), [self._out()]
        return right(self, now)
    monkeypatch.setattr(C.Core, "on_tick", on_tick)
    assert _violated(_named("and the store stops past it")).startswith("doubt only without")


def test_an_interrupt_that_writes_no_abort_is_caught():
    sc = _named("interrupted")
    broken = C.Core.on_interrupt
    try:
        C.Core.on_interrupt = lambda self, now: (self, [])
        res = K.explore(sc)
    finally:
        C.Core.on_interrupt = broken
    assert "abort by an interrupt" not in res.seen  # its peers wait for their deadline


def test_a_livelock_is_caught(monkeypatch):
    """A rank woken for nothing that looks at the wrong key (or takes "it is there now"
    for another spurious wake-up) waits and looks again for ever, with time frozen by
    urgency. The search sees no new state and found no violation; the mutation run of
    issue 29 showed it (``_woken``, ``_fetched``). Every state must reach a final one."""
    right = C.Core._woken

    def woken(self, value):
        if self.spurious:
            return self._to(C.FETCH), [C.Op("check", self.setup.key("D"), tag=C.T_FETCH)]
        return right(self, value)
    monkeypatch.setitem(C._HANDLERS, (C.WAIT, C.T_WAIT), woken)
    assert _violated(_named("outsider")).startswith("terminates: a cycle")


def test_keys_without_the_generation_are_caught(monkeypatch):
    monkeypatch.setattr(S, "prefix", lambda generation, members, position: f"fiws/{members}/{position}/")
    fresh = next(sc for sc in SC.TWO if sc.fresh)
    assert _violated(fresh).startswith(("clean rounds", "agreement", "valid", "clean-up"))


def test_a_trace_names_the_steps_to_the_violation(monkeypatch):
    monkeypatch.setattr(C.Core, "on_tick", lambda self, now: (self, []))
    res = K.explore(SC.TWO[4])
    trace = res.violations[0][1]
    assert trace[0].startswith("start ") and any(step.startswith("serve ") for step in trace)


def test_the_model_stores_what_tcpstore_stores():
    """The model's store semantics on the operations the core uses (system.py's list)."""
    sc = S.Scenario("x", 1, (((S.Call("A"),),),))
    state = S.initial(sc)
    rank = state.ranks[0]._replace(current=(0, 0), main=tuple(
        ((0, 0), op) for op in (C.Op("append", "k", "a"), C.Op("append", "k", "b"),
                                C.Op("cas", "d", "first"), C.Op("cas", "d", "second"),
                                C.Op("delete", "k"))))
    state = state._replace(ranks=(rank,))
    while state.ranks[0].main:  # the delete is served at once after the second cas
        state = S._serve(sc, state, 0, "main")
    assert dict(state.store) == {"d": "first"}
    assert dataclasses.replace(C.Op("get", "x")).kind == "get"
