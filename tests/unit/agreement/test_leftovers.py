"""Rounds some rank never counted out of (issue 23, F4): remembered by a rank that left
before the last one, removed by a later count-out once due, against a real ``HashStore``:
only where some rank's record never came, the register last, one round per pass, only in
the group generation the round ran in."""

from __future__ import annotations

import time

import pytest

from flashinfer_safe_workspace.agreement import leftovers


@pytest.fixture
def store():
    import torch.distributed as dist

    leftovers._forget_all()
    yield dist.HashStore()
    leftovers._forget_all()


class Round:
    """One 2-rank round's keys in the store: rank 0's record only (rank 1 never came), or
    both records (``both=True``)."""

    def __init__(self, store, name, both=False):
        base = f"fiws/0-1/{name}/0/"
        self.records = [base + "rec/0", base + "rec/1"]
        self.register = base + "reg"
        self.others = [base + k for k in ("arrived", "ready", "done")]
        present = self.records if both else self.records[:1]
        for key in (*present, self.register, *self.others):
            store.set(key, "x")
        self.keys = [*present, self.register, *self.others]

    def remember(self, not_before=None, epoch=0):
        due = time.monotonic() - 1 if not_before is None else not_before
        leftovers.remember(self.records, self.register, self.others, due, epoch)


def _left(store, keys):
    return [k for k in keys if store.check([k])]


def test_a_due_round_a_rank_never_joined_is_removed(store):
    r = Round(store, "a")
    r.remember()
    assert leftovers.reap(store, 0, 0) == 1
    assert _left(store, r.keys) == []
    assert leftovers.pending() == 0


def test_a_round_not_yet_due_stays_until_it_is(store):
    r = Round(store, "b")
    r.remember(time.monotonic() + 60)
    assert leftovers.reap(store, 0, 0) == 0
    assert _left(store, r.keys) == r.keys
    assert leftovers.pending() == 1


def test_a_round_is_due_at_its_not_before_time(store, monkeypatch):
    r = Round(store, "c")
    r.remember(1000.0)
    clock = type("Clock", (), {"monotonic": staticmethod(lambda: 1000.0)})
    monkeypatch.setattr(leftovers, "time", clock)
    assert leftovers.reap(store, 0, 0) == 1
    assert _left(store, r.keys) == []


def test_a_round_every_rank_published_in_is_left_to_the_ranks(store):
    """Every record is there: every rank is in the round and counts itself out (a rank
    paused after publishing may still read or write the register: never taken from under
    it, whatever its lateness)."""
    r = Round(store, "d", both=True)
    r.remember()
    assert leftovers.reap(store, 0, 0) == 0
    assert _left(store, r.keys) == r.keys
    assert leftovers.pending() == 0


def test_a_round_the_last_rank_removed_costs_one_check(store):
    r = Round(store, "e")
    store.delete_key(r.others[-1])  # the last rank out removed the round (done first here)
    r.remember()
    assert leftovers.reap(store, 0, 0) == 0
    assert _left(store, r.keys) == [k for k in r.keys if k != r.others[-1]]
    assert leftovers.pending() == 0


def test_the_register_goes_last(store):
    """A rank that finds no register finds none of the round's other keys either."""
    r = Round(store, "f")
    r.remember()
    order = []

    class Watching:
        def check(self, keys):
            return store.check(keys)

        def delete_key(self, key):
            order.append(key)
            return store.delete_key(key)

    assert leftovers.reap(Watching(), 0, 0) == 1
    assert order[-1] == r.register and sorted(order) == sorted(r.records[:1] + [
        r.records[1], *r.others, r.register])


def test_one_round_per_pass(store):
    rounds = [Round(store, f"g{i}") for i in range(3)]
    for r in rounds:
        r.remember()
    assert [leftovers.reap(store, 0, 0) for _ in range(4)] == [1, 1, 1, 0]
    assert all(_left(store, r.keys) == [] for r in rounds)


def test_a_store_error_on_one_round_keeps_the_next_for_the_next_pass(store):
    class FailsOnce:
        def __init__(self):
            self.failed = False

        def check(self, keys):
            if not self.failed:
                self.failed = True
                raise RuntimeError("store timeout")
            return store.check(keys)

        def delete_key(self, key):
            return store.delete_key(key)

    first, second = Round(store, "h"), Round(store, "i")
    first.remember()
    second.remember()
    failing = FailsOnce()
    assert leftovers.reap(failing, 0, 0) == 0  # dropped, never raised
    assert _left(store, first.keys) == first.keys
    assert leftovers.reap(failing, 0, 0) == 1
    assert _left(store, second.keys) == []


def test_a_round_of_a_replaced_group_is_dropped_not_removed(store):
    """A new default group numbers its rounds from 0 again: the same key names on its store
    may be one of its own live rounds (seen as a stray key under load in the 50-re-init
    test before the generation was kept)."""
    old, new = Round(store, "j"), Round(store, "k")
    old.remember(epoch=0)
    new.remember(epoch=1)
    assert leftovers.reap(store, 1, 1) == 1  # the old group's round: dropped on the way
    assert _left(store, old.keys) == old.keys
    assert _left(store, new.keys) == [] and leftovers.pending() == 0


def test_a_late_count_out_of_a_replaced_group_touches_nothing(store):
    """A count-out of the old group, late on its line, once a new group is in place: it
    neither removes nor drops the new group's rounds."""
    r = Round(store, "l")
    r.remember(epoch=1)
    assert leftovers.reap(store, 0, 1) == 0
    assert leftovers.pending() == 1 and _left(store, r.keys) == r.keys


def test_the_oldest_are_forgotten_beyond_the_limit(store, monkeypatch):
    monkeypatch.setattr(leftovers, "LIMIT", 2)
    rounds = [Round(store, f"m{i}") for i in range(3)]
    for r in rounds:
        r.remember()
    assert leftovers.pending() == 2
    assert [leftovers.reap(store, 0, 0) for _ in range(3)] == [1, 1, 0]
    assert _left(store, rounds[0].keys) == rounds[0].keys  # forgotten: its keys stay
    assert _left(store, rounds[2].keys) == []


def test_a_pass_of_several_rounds_goes_past_the_ones_it_skips(store, monkeypatch):
    """With more than one round per pass (PER_PASS), a round the last rank out removed and
    one whose store operation fails are passed over, and every other due round is removed
    and counted (with PER_PASS = 1, the default, each pass looks at one round only)."""
    monkeypatch.setattr(leftovers, "PER_PASS", 4)
    gone, failing, first, second = (Round(store, n) for n in ("g", "h", "i", "j"))
    store.delete_key(gone.others[-1])  # removed by the last rank out
    for r in (gone, failing, first, second):
        r.remember()

    class Failing:
        def check(self, keys):
            return store.check(keys)

        def delete_key(self, key):
            if key.startswith("fiws/0-1/h/"):
                raise RuntimeError("the store did not answer")
            return store.delete_key(key)

    assert leftovers.reap(Failing(), 0, 0) == 2
    assert _left(store, first.keys) == [] and _left(store, second.keys) == []
    assert _left(store, failing.keys) != []
    assert leftovers.pending() == 0
