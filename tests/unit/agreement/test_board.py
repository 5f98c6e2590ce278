"""The board: which of two ranks waiting in different rounds gives way.

Real torch ``HashStore`` (the c10d store's in-process kind) behind a one-line stand-in for
our store line; the round is a real ``StoreRound``, its peers' board entries real
``record.Board`` values. Whatever the order in which the two ranks look at the boards, the
rank that has made fewer calls on the set gives way, and the round of the rank ahead is
never aborted: that is the round the one behind joins next.
"""

import time

import pytest
import torch.distributed as dist

from flashinfer_safe_workspace.agreement import board, round as round_
from flashinfer_safe_workspace.agreement.record import ABORT, Board, Register


class Line:
    """What a round needs of a store line: ``call(fn, until)`` runs ``fn(store)``."""

    def __init__(self, store):
        self.store = store

    def call(self, fn, until):
        return fn(self.store)

    def submit(self, fn):  # pragma: no cover - not reached by these tests
        raise AssertionError("no queued work expected")


def _round(store, me, ident, calls):
    rnd = round_.StoreRound(Line(store), (0, 1), me, ident, time.monotonic() + 5, "t",
                            {"max_token_num": ident})
    rnd.c, rnd.calls = 0, calls
    return rnd


def _peer_waits(store, rnd, peer, ident, calls):
    return _show(store, rnd, peer, 1, ident, "wait", calls)


@pytest.fixture(autouse=True)
def _fresh_book(monkeypatch):
    monkeypatch.setattr(board, "BOOK", board.Book())


@pytest.mark.parametrize("mine, theirs, expect", [
    (2, 3, "finished"),  # the peer is ahead: it answered our call from its cache
    (3, 2, "waiting"),  # the peer is behind: it makes a call we skipped
    (2, 2, "waiting"),  # the same count, different calls: a mismatch, both give way
])
def test_who_gives_way(mine, theirs, expect):
    store = dist.HashStore()
    rnd = _round(store, 0, "callB", mine)
    their_reg = _peer_waits(store, rnd, 1, "callC", theirs)
    waiting, finished = board.Watch(rnd).mismatches(abort_theirs=True)
    assert [r.rank for r in (waiting if expect == "waiting" else finished)] == [1]
    assert not (finished if expect == "waiting" else waiting)
    aborted = store.check([their_reg])
    assert aborted == (expect == "waiting")
    if aborted:
        reg = Register.from_json(store.get(their_reg))
        assert reg.outcome == ABORT and reg.mismatch[0].args == {"max_token_num": "callB"}


def test_either_order_one_round_survives():
    """Rank 1 fell behind (its call count is 2; rank 0, ahead, is at 3). Whichever looks
    first, rank 1's round is the one that ends and rank 0's stays open for rank 1 to join."""
    for first in (0, 1):
        store = dist.HashStore()
        board.BOOK = board.Book()
        ahead, behind = _round(store, 0, "callC", 3), _round(store, 1, "callB", 2)
        reg_ahead = _peer_waits(store, behind, 0, "callC", 3)
        reg_behind = _peer_waits(store, ahead, 1, "callB", 2)
        order = (ahead, behind) if first == 0 else (behind, ahead)
        told = [board.Watch(r).mismatches(abort_theirs=True) for r in order]
        by_round = dict(zip((r.ident for r in order), told))
        assert [p.rank for p in by_round["callB"][1]] == [0]  # behind ends its own round
        assert [p.rank for p in by_round["callC"][0]] == [1]  # ahead keeps waiting
        assert not store.check([reg_ahead])  # the round to join was never aborted
        assert store.check([reg_behind])


def _show(store, rnd, peer, gen, ident, state, calls):
    entry = Board(generation=gen, round=f"{ident}/0", state=state, args={"x": ident}, calls=calls)
    store.set(board.board_key(rnd.mkey, peer), entry.to_json())
    return f"fiws/{rnd.mkey}/{ident}/0/reg"


def test_a_peer_two_calls_behind_is_waited_for_through_each_of_its_rounds(monkeypatch):
    """Rank 0 waits in its third call (C); rank 1 is still in its first (A), then makes its
    second (B) alone, then comes to C. Every round of rank 1's that rank 0 sees waiting is
    aborted (it is a call rank 0 answered without it), every one it has finished is left
    alone, and rank 0 never ends its own round while rank 1 shows progress, however long it
    takes between two rounds (REJOIN_S set to 0; the patience for a behind peer, BEHIND_S,
    is not reached). Seen under load before the fix: rank 1 moving on from the aborted A to
    B read as "not coming", and C was vetoed on both ranks."""
    monkeypatch.setattr(board, "REJOIN_S", 0.0)
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    watch = board.Watch(rnd)
    steps = [(1, "callA", "wait", 1, True), (1, "callA", "done", 1, False),
             (2, "callB", "wait", 2, True), (2, "callB", "done", 2, False),
             (2, "callB", "done", 2, False)]
    for gen, ident, state, calls, aborted in steps:
        their_reg = _show(store, rnd, 1, gen, ident, state, calls)
        waiting, finished = watch.mismatches(abort_theirs=True)
        assert finished == []
        assert [r.rank for r in waiting] == ([1] if aborted else [])
        assert store.check([their_reg])  # aborted when first seen waiting
    _show(store, rnd, 1, 3, "callC", "wait", 3)  # it has come to ours
    assert watch.mismatches(abort_theirs=True) == ([], [])
    assert not store.check([f"fiws/{rnd.mkey}/callC/0/reg"])


def test_a_peer_behind_that_said_no_is_still_waited_for():
    """Rank 1, one call behind, said no in a call rank 0 answered from its cache: it comes
    to rank 0's round next, so that is no reason to end it."""
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    _show(store, rnd, 1, 5, "callB", "no", 2)
    assert board.Watch(rnd).mismatches(abort_theirs=True) == ([], [])


@pytest.mark.parametrize("state", ["no", "done"])
def test_a_peer_at_the_same_count_that_finished_another_call_is_not_coming(state):
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    _show(store, rnd, 1, 5, "callX", state, 3)
    waiting, finished = board.Watch(rnd).mismatches(abort_theirs=True)
    assert waiting == [] and [r.rank for r in finished] == [1]


def test_a_mismatched_peer_that_does_not_rejoin_ends_our_round(monkeypatch):
    """The same count, another call: its round is aborted while it waits; once it has
    finished it and not come to ours within REJOIN_S (0 here), ours ends too; before that
    (REJOIN_S large) we keep waiting."""
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    watch = board.Watch(rnd)
    _show(store, rnd, 1, 4, "callX", "wait", 3)
    assert [r.rank for r in watch.mismatches(abort_theirs=True)[0]] == [1]
    _show(store, rnd, 1, 4, "callX", "done", 3)
    monkeypatch.setattr(board, "REJOIN_S", 60.0)
    assert watch.mismatches(abort_theirs=True) == ([], [])
    monkeypatch.setattr(board, "REJOIN_S", 0.0)
    time.sleep(0.001)  # strictly after the moment it was first seen done
    assert [r.rank for r in watch.mismatches(abort_theirs=True)[1]] == [1]
    _show(store, rnd, 1, 6, "callY", "wait", 4)  # or it moved on past ours: ahead
    assert [r.rank for r in watch.mismatches(abort_theirs=True)[1]] == [1]


def test_a_peer_behind_without_progress_for_the_patience_is_not_coming(monkeypatch):
    """A call one rank made alone skews the counts for good: a peer that looks behind may
    have made its own, different call. Once its finished entry has shown no progress for
    the patience (0 here), our round ends as a mismatch; progress starts the wait again."""
    monkeypatch.setattr(board, "BEHIND_S", 0.0)
    monkeypatch.setattr(board, "REJOIN_S", 0.0)
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 2)
    watch = board.Watch(rnd)
    _show(store, rnd, 1, 1, "callD", "done", 1)
    assert watch.mismatches(abort_theirs=True) == ([], [])  # first seen finished: the clock starts
    _show(store, rnd, 1, 2, "callE", "no", 1)  # progress (a newer entry): the clock starts again
    assert watch.mismatches(abort_theirs=True) == ([], [])
    time.sleep(0.001)
    waiting, finished = watch.mismatches(abort_theirs=True)
    assert waiting == [] and [(r.rank, r.args) for r in finished] == [(1, {"x": "callE"})]


@pytest.mark.parametrize("vote_timeout, patience", [
    (0.0, 5.0),  # a round without a vote timeout set: BEHIND_S
    (120.0, 5.0), (8.0, 2.0),  # a quarter of the vote timeout, at most BEHIND_S
    (1.0, 0.5),  # at least REJOIN_S
])
def test_the_patience_for_a_peer_behind(vote_timeout, patience):
    rnd = _round(dist.HashStore(), 0, "callC", 2)
    rnd.line_timeout = vote_timeout
    assert board.Watch(rnd)._patience() == patience


def test_a_peer_behind_waiting_in_a_round_we_finished_is_old_news():
    """Rank 1, behind, still waits in the round of a call rank 0 has finished (decided
    there): nothing to abort, nothing to report, and it is noted as seen."""
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    rnd.book.consume(rnd.mkey, "callA", 0)  # rank 0 finished callA/0
    their_reg = _show(store, rnd, 1, 4, "callA", "wait", 1)
    assert board.Watch(rnd).mismatches(abort_theirs=True) == ([], [])
    assert not store.check([their_reg])
    assert rnd.book.seen(rnd.mkey) == {1: 4}


def test_a_peer_entry_already_seen_is_not_news():
    """A generation this rank has already noted (its wrap-up saw it, or it aborted that
    round) is neither aborted again nor reported, even at the same count."""
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    rnd.book.mark_seen(rnd.mkey, 1, 4)
    their_reg = _show(store, rnd, 1, 4, "callX", "wait", 3)
    assert board.Watch(rnd).mismatches(abort_theirs=True) == ([], [])
    assert not store.check([their_reg])
    _show(store, rnd, 1, 5, "callX", "wait", 3)  # a newer generation is news
    assert [r.rank for r in board.Watch(rnd).mismatches(abort_theirs=True)[0]] == [1]


def test_a_later_round_of_a_call_we_finished_is_news():
    """Rank 0 finished round 0 of callA; rank 1, behind, waits in round 1 of callA (a call
    it made again): that round is not old news, and it is aborted."""
    store = dist.HashStore()
    rnd = _round(store, 0, "callC", 3)
    rnd.book.consume(rnd.mkey, "callA", 0)
    entry = Board(generation=4, round="callA/1", state="wait", args={"x": "callA"}, calls=2)
    store.set(board.board_key(rnd.mkey, 1), entry.to_json())
    waiting, finished = board.Watch(rnd).mismatches(abort_theirs=True)
    assert [r.rank for r in waiting] == [1] and finished == []
    assert store.check([f"fiws/{rnd.mkey}/callA/1/reg"])


def test_every_peer_is_judged_on_its_own():
    """Three ranks: rank 0 waits in callC (3 calls). Rank 1 shows nothing new, rank 2 is
    behind and waits elsewhere: only rank 2 is reported (and aborted). Then rank 1 has
    finished another call at the same count: both are reported, each in its own list."""
    store = dist.HashStore()
    rnd = round_.StoreRound(Line(store), (0, 1, 2), 0, "callC", time.monotonic() + 5, "t",
                            {"max_token_num": "callC"})
    rnd.c, rnd.calls = 0, 3
    rnd.book.mark_seen(rnd.mkey, 1, 2)
    _show(store, rnd, 1, 2, "callX", "wait", 3)
    reg2 = _show(store, rnd, 2, 7, "callB", "wait", 2)
    watch = board.Watch(rnd)
    waiting, finished = watch.mismatches(abort_theirs=True)
    assert [r.rank for r in waiting] == [2] and finished == []
    assert store.check([reg2])
    _show(store, rnd, 1, 3, "callY", "done", 3)
    _show(store, rnd, 2, 8, "callB2", "wait", 2)
    waiting, finished = watch.mismatches(abort_theirs=True)
    assert [r.rank for r in waiting] == [2] and [r.rank for r in finished] == [1]
