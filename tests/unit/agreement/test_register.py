"""The register's first-write-wins rule, against a real ``torch.distributed.HashStore`` in
this process (no ranks, no sockets): whichever of a commit and an abort lands first is what
the register holds, and every later writer (an abort at a deadline, an interrupt's abort,
the last acknowledgement's commit) reads that value back instead of overwriting it. Written
with ``set`` instead of ``compare_set``, a rank aborting at its deadline just after a peer's
commit would turn a created workspace into a split."""

from __future__ import annotations

import time

import pytest

from flashinfer_safe_workspace.agreement import round as _round, store as _store
from flashinfer_safe_workspace.agreement.record import (ABORT, COMMIT, PROPOSE, WAKE, Register)

BOUND_S = 30.0  # a bound only (every step here is an in-memory store operation)


@pytest.fixture
def hashstore():
    import torch.distributed as dist

    return dist.HashStore()


def round_of(store, rank, ident="unit-call"):
    """Rank ``rank``'s round 0 of a call over ranks (0, 1) on ``store`` (a line of its own)."""
    line = _store.StoreLine(lambda: store)
    rnd = _round.StoreRound(line, (0, 1), rank, ident, time.monotonic() + BOUND_S, "unit")
    rnd.c = 0
    return rnd


def held(store, rnd) -> Register:
    return Register.from_json(store.get(rnd._k("reg")))


def last_ack(store, rnd):
    """Rank ``rnd``'s acknowledging steps after the proposal: with two ranks its
    acknowledgement completes the count and writes commit."""
    store.set(rnd._k("ready"), PROPOSE)
    return Register.from_json(rnd._acknowledging()(store))


def test_the_last_acknowledgement_commits(hashstore):
    r1 = round_of(hashstore, 1)
    reg = last_ack(hashstore, r1)
    assert (reg.outcome, reg.by) == (COMMIT, 1)
    assert held(hashstore, r1) == reg


def test_an_abort_at_the_deadline_after_a_commit_reads_the_commit(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    committed = last_ack(hashstore, r1)
    got = r0._write(ABORT, "rank 0 reached its deadline")
    assert got == committed and got.commit
    assert held(hashstore, r0) == committed
    assert hashstore.get(r0._k("ready")).decode() == PROPOSE  # no wake over a proposal


def test_a_final_try_after_a_commit_reads_the_commit(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    committed = last_ack(hashstore, r1)
    assert r0._final("rank 0 reached its deadline") == committed
    assert held(hashstore, r0) == committed


def test_an_interrupt_after_a_commit_leaves_the_commit(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    committed = last_ack(hashstore, r1)
    r0.abort_now("interrupted")
    op = r0.line.submit(lambda s: s.get(r0._k("reg")))  # behind the abort on its line
    assert op.done.wait(BOUND_S)
    assert Register.from_json(op.value) == committed


def test_a_commit_after_an_abort_reads_the_abort(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    aborted = r0._write(ABORT, "rank 0 reached its deadline")
    assert (aborted.outcome, aborted.by) == (ABORT, 0)
    assert hashstore.get(r0._k("ready")).decode() == WAKE  # the waiters are woken
    got = r1._acknowledging()(hashstore)  # ready is WAKE: rank 1 reads the register
    assert Register.from_json(got) == aborted
    # a commit written late (a rank without a waiting line) loses as well
    assert r1._write(COMMIT, "every rank voted yes and acknowledged") == aborted
    assert held(hashstore, r1) == aborted


def test_an_acknowledgement_after_an_abort_landed_reads_the_abort(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    hashstore.set(r0._k("ready"), PROPOSE)  # proposed, then rank 0's deadline aborts
    aborted = r0._write(ABORT, "rank 0 reached its deadline")
    got = Register.from_json(r1._acknowledging()(hashstore))  # the count completes: commit tried
    assert got == aborted and held(hashstore, r1) == aborted


def test_two_aborts_keep_the_first(hashstore):
    r0, r1 = round_of(hashstore, 0), round_of(hashstore, 1)
    first = r0._write(ABORT, "first")
    assert r1._write(ABORT, "second") == first
    assert r1._final("third") == first
    assert held(hashstore, r0).why == "first"


def test_an_interrupt_on_an_open_round_aborts_it_and_wakes_the_waiters(hashstore):
    r0 = round_of(hashstore, 0)
    r0.abort_now("interrupted")
    op = r0.line.submit(lambda s: (s.get(r0._k("reg")), s.get(r0._k("ready"))))
    assert op.done.wait(BOUND_S)
    reg, ready = op.value
    assert Register.from_json(reg) == Register(ABORT, 0, "interrupted")
    assert ready.decode() == WAKE
    assert r0.finished and r0.book.next_round(r0.mkey, r0.ident) == 1  # this round is spent


def test_an_interrupt_before_or_after_a_round_writes_nothing(hashstore):
    r0 = round_of(hashstore, 0)
    r0.c = None  # not opened yet
    r0.abort_now("interrupted")
    r0.c = 0
    r0.finished = True  # already over
    r0.abort_now("interrupted")
    op = r0.line.submit(lambda s: s.check([r0._k("reg")]) or s.check([r0._k("ready")]))
    assert op.done.wait(BOUND_S) and op.value is False


def test_a_final_try_on_an_open_round_writes_the_abort(hashstore):
    r0 = round_of(hashstore, 0)
    assert r0._final("rank 0 reached its deadline") == Register(ABORT, 0, "rank 0 reached its deadline")
