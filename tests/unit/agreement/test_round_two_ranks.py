"""One round of the store protocol (``agreement/round.StoreRound``) between two ranks played
by two threads of this process over one real in-memory ``HashStore``: each rank has its own
store line, its own waiting lines and its own bookkeeping, as two processes would. Outcomes,
never timings, are asserted: every wait is bounded by the round's deadline."""

from __future__ import annotations

import threading
import time

import pytest

from flashinfer_safe_workspace import _decide  # noqa: F401 - registers checks.compare (vote.use_comparison)
from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace.agreement import board as _board, explain as _explain, round as _round
from flashinfer_safe_workspace.agreement import store as _store
from flashinfer_safe_workspace.agreement.record import ABORT, COMMIT, NO, PASS, PASS_STATE, Register
from unit.facts import record, with_check

BOUND_S = 10.0  # the round's deadline: a bound, never reached on the paths asserted here
NO_LINE = -1  # a round's epoch that gets no waiting line (a replaced group's round)


@pytest.fixture
def hashstore(monkeypatch):
    """One store for both ranks; every blocking wait on a line of its own on that store."""
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(_store, "waiter", lambda timeout, key="", line_epoch=None: None
                        if line_epoch == NO_LINE else _store.StoreLine(lambda: store))
    return store


_LINES: list = []  # the store lines this test's ranks made (drained when it ends)


@pytest.fixture(autouse=True)
def _drained():
    """Each round's wrap-up (count-out, and remembering a round left incomplete in
    ``leftovers``) runs on its rank's store line after ``vote`` has returned: wait for
    every line of the test to be through it, then forget what was remembered, so that no
    wrap-up lands in the next test (seen: mutmut's clean run put a leftovers test right
    after one of these, and a late ``remember`` stood at the head of its queue)."""
    from flashinfer_safe_workspace.agreement import leftovers

    yield
    for line in _LINES:
        assert line.submit(lambda s: None).done.wait(BOUND_S)
    _LINES.clear()
    leftovers._forget_all()


def rank(store, r, ranks=(0, 1), ident="unit-round", bound=BOUND_S):
    line = _store.StoreLine(lambda: store)
    _LINES.append(line)
    rnd = _round.StoreRound(line, ranks, ranks.index(r), ident,
                            time.monotonic() + bound, "unit")
    rnd.book = _board.Book()  # this rank's own bookkeeping (one per process)
    rnd.line_timeout = bound
    return rnd


def together(*pairs):
    """``rnd.open()`` then ``rnd.vote(rec)`` for each (rnd, rec), each on its own thread."""
    out = [None] * len(pairs)

    def go(i, rnd, rec):
        early = rnd.open()
        out[i] = early if early is not None else rnd.vote(rec)

    threads = [threading.Thread(target=go, args=(i, *p), daemon=True) for i, p in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S + 5)
    assert all(o is not None for o in out), out
    return out


def keys_left(store, rnd) -> list:
    names = [rnd._k(k) for k in ("reg", "arrived", "ready", "acks", "done")] + rnd._rec_keys()
    return [k for k in names if store.check([k])]


def wait_finished(rnd):
    op = rnd.line.submit(lambda s: None)  # behind the round's wrap-up on its line
    assert op.done.wait(BOUND_S)


def test_every_rank_yes_commits_on_both(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    a, b = together((r0, record(0)), (r1, record(1)))
    assert a.commit and b.commit
    assert a.register == b.register and a.register.outcome == COMMIT
    assert a.key == b.key == r0._k()
    proposer = a if a.verdict is not None else b
    assert proposer.verdict.commit and len(proposer.records) == 2
    for r in (r0, r1):
        wait_finished(r)
    assert keys_left(hashstore, r0) == []  # the last rank through removed the round's keys


def test_one_no_aborts_on_both_with_its_check(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    no = record(1, state=NO, reason=R.NO_MULTICAST,
                checks_=with_check("multicast", "multicast=0", ok=False, code=R.NO_MULTICAST))
    a, b = together((r0, record(0)), (r1, no))
    assert not a.commit and not b.commit
    assert a.register == b.register
    reg = a.register
    assert (reg.outcome, reg.by, reg.check, reg.reasons) == (ABORT, 1, "multicast", (R.NO_MULTICAST,))


def test_plans_that_differ_abort_on_both(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    a, b = together((r0, record(0, digest="x")), (r1, record(1, digest="y")))
    assert (a.commit, b.commit) == (False, False) and a.register == b.register
    assert a.register.why == "plans differ between ranks"


def test_every_rank_passing_is_a_pass_on_both(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    a, b = together((r0, record(0, state=PASS_STATE)), (r1, record(1, state=PASS_STATE)))
    assert a.register == b.register and a.register.outcome == PASS
    assert not a.commit and not b.commit


def test_different_calls_abort_on_both(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    a, b = together((r0, record(0, call="c1", args={"n": 1})), (r1, record(1, call="c2", args={"n": 2})))
    assert not a.commit and a.register == b.register
    assert a.register.why == "ranks called with different arguments"


def test_a_rank_that_never_comes_ends_in_an_abort_at_the_deadline(hashstore):
    r0 = rank(hashstore, 0, bound=0.3)
    (a,) = together((r0, record(0)))
    assert not a.commit and a.register.outcome == ABORT and a.register.by == 0
    assert a.absent == (1,)
    assert a.missing.startswith("timed out after ") and a.missing.endswith("waiting for ranks [1]")
    # the late rank follows the abort decided before it arrived: its open() makes no store
    # operation (issue 25), the register is read in the hand-off that publishes its record
    r1 = rank(hashstore, 1)
    assert r1.open() is None
    late = r1.vote(record(1))
    assert late.followed and not late.commit
    assert late.register == a.register
    assert late.missing.startswith("decided before this rank arrived")


def test_a_second_round_of_the_same_call_uses_new_keys(hashstore):
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    together((r0, record(0)), (r1, record(1)))
    s0, s1 = rank(hashstore, 0), rank(hashstore, 1)
    s0.book, s1.book = r0.book, r1.book  # the same processes, their second call
    a, b = together((s0, record(0)), (s1, record(1)))
    assert a.commit and b.commit and s0.c == r0.c + 1 == s1.c


def test_a_no_names_each_candidate_or_says_no(hashstore):
    from flashinfer_safe_workspace.agreement.record import Candidate

    two = record(1, auto=True, cands={"nomc": Candidate(NO, R.OUT_OF_MEMORY, "buf"),
                                      "mc": Candidate(NO, R.NO_MULTICAST)})
    (out,) = together((rank(hashstore, 1), two))
    assert out.register.why == ("rank 1: out of memory: buf; rank 1: no NVLink multicast on a "
                                "path that creates a multicast object")
    empty = record(1, cands={})
    (out,) = together((rank(hashstore, 1, ident="other"), empty))
    assert (out.register.outcome, out.register.why) == (ABORT, "rank 1 said no: no")


def test_a_rank_without_a_waiting_line_acknowledges_step_by_step(hashstore):
    """Rank 1 (a round of a replaced group: no waiting line) publishes first and polls;
    rank 0 completes the set and proposes; rank 1 acknowledges on its first line and its
    acknowledgement commits."""
    r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
    r1.epoch = NO_LINE
    out = {}
    t = threading.Thread(target=lambda: out.update(b=r1.open() or r1.vote(record(1))), daemon=True)
    t.start()
    op_until = time.monotonic() + BOUND_S
    while not hashstore.check([r1._k("rec", 1)]):
        assert time.monotonic() < op_until
        time.sleep(0.01)
    (a,) = together((r0, record(0)))
    t.join(BOUND_S + 5)
    b = out["b"]
    assert a.commit and b.commit and a.register == b.register
    assert (b.register.outcome, b.register.by) == (COMMIT, 1)


def test_a_round_left_incomplete_is_counted_out_and_remembered(hashstore):
    """Rank 0 alone (rank 1 never comes): its wrap-up marks its board entry done, notes the
    peer's board generation as seen, counts itself out (1 of 2), remembers the round's keys
    for a later removal (its deadline + one vote timeout + the grace) and removes an
    earlier round already due."""
    from flashinfer_safe_workspace.agreement import leftovers
    from flashinfer_safe_workspace.agreement.record import Board
    from flashinfer_safe_workspace.agreement.vote import GRACE_S

    leftovers._forget_all()
    try:
        old = ["fiws/old/0/rec/0", "fiws/old/0/reg", "fiws/old/0/done"]
        for key in old:
            hashstore.set(key, "x")
        r0 = rank(hashstore, 0, bound=0.3)
        leftovers.remember(["fiws/old/0/rec/0", "fiws/old/0/rec/1"], old[1], old[2:],
                           time.monotonic() - 1, r0.epoch)  # due now (rank 1's record never came)
        r0.book.world = 0  # this default group's generation on the store (board.world_of)
        hashstore.set(r0._board_key(1), Board(7, "other/0", "wait", world=0).to_json())
        (a,) = together((r0, record(0)))
        assert not a.commit and a.absent == (1,)
        wait_finished(r0)
        mine = Board.from_json(hashstore.get(r0._board_key(0)))
        assert (mine.state, mine.round) == ("done", r0.round_name)
        assert r0.book.seen(r0.mkey) == {1: 7}
        assert hashstore.get(r0._k("done")) == b"1"
        others = tuple(r0._k(k) for k in ("arrived", "ready", "acks", "done"))
        assert list(leftovers._rounds) == [(r0.deadline + r0.line_timeout + GRACE_S, r0.epoch,
                                            tuple(r0._rec_keys()), r0._k("reg"), others)]
        assert not any(hashstore.check([k]) for k in old)  # the due round was removed
        assert hashstore.check([r0._k("reg")])  # this round's keys stay until due
    finally:
        leftovers._forget_all()


def test_a_complete_round_notes_no_peer_and_leaves_nothing_to_remember(hashstore):
    from flashinfer_safe_workspace.agreement import leftovers
    from flashinfer_safe_workspace.agreement.record import Board

    leftovers._forget_all()
    try:
        r0, r1 = rank(hashstore, 0), rank(hashstore, 1)
        a, b = together((r0, record(0)), (r1, record(1)))
        assert a.commit and b.commit
        for r in (r0, r1):
            wait_finished(r)
        assert leftovers.pending() == 0
        assert r0.book.seen(r0.mkey) == {} and r1.book.seen(r1.mkey) == {}
        for r in (0, 1):  # a completed round leaves the board entries as they were
            assert Board.from_json(hashstore.get(r0._board_key(r))).state != "done"
    finally:
        leftovers._forget_all()


def _decided(store, rnd, c, reg):
    """Write ``reg`` as the register of round ``c`` of ``rnd``'s call (before it opens)."""
    rnd.c = c
    store.set(rnd._k("reg"), reg.to_json())
    rnd.c = None


@pytest.mark.parametrize("stale", [1, 2])
def test_stale_commits_are_skipped_to_the_first_undecided_round(hashstore, stale):
    """A commit this rank did not publish in is never followed: the rank moves on to the
    next round, as many times as there are such commits."""
    r1 = rank(hashstore, 1, bound=0.3)
    for c in range(stale):
        _decided(hashstore, r1, c, Register(COMMIT, 0, "every rank voted yes"))
    assert r1.open() is None
    out = r1.vote(record(1))
    assert r1.c == stale and out.key == r1._k()
    assert not out.followed and out.register.outcome == ABORT and out.absent == (0,)


@pytest.mark.parametrize("why,missing", [
    ("rank 0 said no: x", "decided before this rank arrived: rank 0 said no: x"),
    ("", "decided before this rank arrived: abort"),
])
def test_an_abort_decided_before_arrival_is_followed(hashstore, why, missing):
    r1 = rank(hashstore, 1)
    _decided(hashstore, r1, 0, Register(ABORT, 0, why))
    assert r1.open() is None
    out = r1.vote(record(1))
    assert out.commit is False and out.followed and out.key == r1._k() and r1.c == 0
    assert out.register == Register(ABORT, 0, why) and out.missing == missing


def test_a_mismatch_seen_on_the_board_follows_a_register_decided_first(hashstore):
    """Rank 1 waits in its round of call A (its first call on the set); rank 0 has already
    said no there (out of memory: the register is written, its wake-up not yet) and moved
    on to its third call, where the board shows it waiting. Rank 1's look at the boards
    finds a peer ahead of it and writes its mismatch abort, which loses to the register
    already there: rank 1 follows that register (rank 0's no, its reasons), not its own
    guess. Seen on a loaded CI machine: the first call's reason read ARG_MISMATCH."""
    from flashinfer_safe_workspace import _points
    from flashinfer_safe_workspace.agreement.record import Board

    r1 = rank(hashstore, 1, ident="A")
    r1.book.world = 0
    no = Register(ABORT, 0, "rank 0: out of memory", check="memory", reasons=(R.OUT_OF_MEMORY,))

    def rank0_went_on(name):  # between rank 1's publish and its wait for the wake-up
        if name == "round.published":
            hashstore.set(r1._k("reg"), no.to_json())
            hashstore.set(r1._board_key(0), Board(3, "C/0", "wait", {"max_token_num": 256},
                                                  calls=3, world=0).to_json())
    _points.install(rank0_went_on)
    try:
        (out,) = together((r1, record(1, call="A", args={"max_token_num": 2048})))
    finally:
        _points.install(None)
    assert r1.calls == 1 and not out.commit
    assert out.register == no
    assert out.verdict is None or not out.verdict.mismatch
    info = _explain.veto(out, None, None, record(1))
    assert info.reasons == (R.OUT_OF_MEMORY,)
    assert "max_token_num" not in info.message


def test_after_a_call_one_rank_made_alone_a_mismatch_ends_within_the_patience(hashstore, monkeypatch):
    """Rank 0 made one call on the set that rank 1 never made (its count is one ahead for
    good); then rank 0 calls C and rank 1 calls D. Rank 1 sees rank 0 ahead and ends its
    round; rank 0 sees rank 1 behind, finished, with no progress: after the patience (0.5 s
    here) its round ends as a mismatch, named so (not a timeout, not cached), well before
    its 20 s deadline. Found by review: without the patience rank 0 waited out its vote
    timeout and cached a bare timeout abort."""
    from flashinfer_safe_workspace import _decide as decide

    monkeypatch.setattr(_board, "BEHIND_S", 0.5)
    r0, r1 = rank(hashstore, 0, ident="C", bound=20.0), rank(hashstore, 1, ident="D", bound=20.0)
    for r in (r0, r1):
        r.book.world = 0
    r0.book.count_call(r0.mkey)  # the call rank 0 made alone
    a, b = together((r0, record(0, call="C", args={"n": 1})), (r1, record(1, call="D", args={"n": 2})))
    assert not a.commit and not b.commit
    for out, r in ((a, 0), (b, 1)):
        assert not out.missing, out.missing  # ended by the board, not by the deadline
        assert _explain.veto(out, None, None, record(r)).reasons == (R.ARG_MISMATCH,)
        assert not decide._keep(out, "store")


def test_a_late_peer_after_a_veto_is_waited_for_not_read_as_elsewhere(hashstore, monkeypatch):
    """Call P is vetoed on both ranks (rank 1 said no: its board entry stays "no" there).
    Then rank 0 makes call C, and rank 1 comes to C only after rank 0 has looked at the
    boards three times, with the patience for a peer behind at 0: rank 1's entry is one of
    a round rank 0 finished too, no sign that it is elsewhere, so rank 0 keeps waiting and
    both create. Found by review: the patience read that stale entry as "not coming" and
    vetoed C, and every later call of a peer that kept coming late."""
    monkeypatch.setattr(_board, "BEHIND_S", 0.0)
    monkeypatch.setattr(_board, "REJOIN_S", 0.0)
    p0, p1 = rank(hashstore, 0, ident="P"), rank(hashstore, 1, ident="P")
    for r in (p0, p1):
        r.book.world = 0
    a, b = together((p0, record(0, call="P", args={"n": 1})),
                    (p1, record(1, call="P", args={"n": 1}, state=NO, reason=R.OUT_OF_MEMORY)))
    assert not a.commit and not b.commit
    r0, r1 = rank(hashstore, 0, ident="C"), rank(hashstore, 1, ident="C")
    r0.book, r1.book = p0.book, p1.book
    looks, go = [], threading.Event()
    look = r0._watch.mismatches

    def counted(abort_theirs):
        found = look(abort_theirs)
        looks.append(found)
        if len(looks) >= 3:
            go.set()
        return found
    r0._watch.mismatches = counted
    out = {}

    def late():
        if go.wait(BOUND_S):
            out[1] = r1.open() or r1.vote(record(1, call="C", args={"n": 2}))
    t = threading.Thread(target=late, daemon=True)
    t.start()
    (out[0],) = together((r0, record(0, call="C", args={"n": 2})))
    t.join(BOUND_S + 5)
    assert len(looks) >= 3 and all(found == ([], []) for found in looks)
    assert out[0].commit and out[1].commit
