"""Rounds some rank never counted out of (issue 23, F4): remembered by a rank that left
before the last one, removed by a later count-out once due, against a real ``HashStore``."""

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


def _round(store, name, n=3):
    keys = [f"fiws/0-1/{name}/0/{k}" for k in ("rec/0", "reg", "arrived", "done")][:n] + [
        f"fiws/0-1/{name}/0/done"]
    for key in keys:
        store.set(key, "x")
    return keys[-1], keys


def test_a_due_round_still_in_the_store_is_removed(store):
    done, keys = _round(store, "a")
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(store, 0) == 1
    assert not any(store.check([k]) for k in keys)
    assert leftovers.pending() == 0


def test_a_round_not_yet_due_stays_until_it_is(store):
    done, keys = _round(store, "b")
    leftovers.remember(done, keys, time.monotonic() + 60, 0)
    assert leftovers.reap(store, 0) == 0
    assert all(store.check([k]) for k in keys)
    assert leftovers.pending() == 1


def test_a_round_the_last_rank_removed_costs_one_check(store):
    done, keys = _round(store, "c")
    other_key = "fiws/0-1/c/0/rec/1"  # not the round's remembered key: must stay
    store.set(other_key, "y")
    store.delete_key(done)  # the last rank out removed the round
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(store, 0) == 0
    assert store.check([other_key]) and store.check([keys[0]])
    assert leftovers.pending() == 0


def test_a_pass_looks_at_no_more_than_per_pass_rounds(store):
    rounds = [_round(store, f"d{i}") for i in range(leftovers.PER_PASS + 3)]
    for done, keys in rounds:
        leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(store, 0) == leftovers.PER_PASS
    assert leftovers.pending() == 3
    assert leftovers.reap(store, 0) == 3


def test_a_store_that_fails_keeps_the_rest_going(store):
    class Failing:
        def check(self, keys):
            raise RuntimeError("store gone")

    done, keys = _round(store, "e")
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(Failing(), 0) == 0  # dropped, never raised
    assert leftovers.pending() == 0


def test_the_oldest_are_forgotten_beyond_the_limit(store, monkeypatch):
    monkeypatch.setattr(leftovers, "LIMIT", 2)
    for i in range(3):
        leftovers.remember(f"done{i}", [f"done{i}"], time.monotonic() - 1, 0)
    assert leftovers.pending() == 2
    store.set("done0", "x")
    store.set("done2", "x")
    assert leftovers.reap(store, 0) == 1  # done1 is absent; done0 was forgotten
    assert store.check(["done0"]) and not store.check(["done2"])


def test_a_round_of_a_replaced_group_is_dropped_not_removed(store):
    """A new default group numbers its rounds from 0 again: the same key names on its store
    may be one of its own live rounds (seen as a stray key under load in the 50-re-init
    test before the generation was kept)."""
    done, keys = _round(store, "f")
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(store, 1) == 0
    assert all(store.check([k]) for k in keys)
    assert leftovers.pending() == 0


def test_a_removed_round_does_not_stop_the_pass(store):
    """The first due round was removed by its last rank; the pass still removes the next."""
    gone, gone_keys = _round(store, "f")
    store.delete_key(gone)
    done, keys = _round(store, "g")
    leftovers.remember(gone, gone_keys, time.monotonic() - 1, 0)
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(store, 0) == 1
    assert not any(store.check([k]) for k in keys)
    assert leftovers.pending() == 0


def test_a_round_is_due_at_its_not_before_time(store, monkeypatch):
    done, keys = _round(store, "h")
    leftovers.remember(done, keys, 1000.0, 0)
    monkeypatch.setattr(leftovers, "time", type("Clock", (), {"monotonic": staticmethod(lambda: 1000.0)}))
    assert leftovers.reap(store, 0) == 1
    assert not store.check([done])


def test_a_store_error_on_one_round_does_not_stop_the_pass(store):
    """One round's ``check`` raises (dropped); the next round of the same pass is removed."""
    class FailsOnce:
        def __init__(self, s):
            self.s, self.failed = s, False

        def check(self, keys):
            if not self.failed:
                self.failed = True
                raise RuntimeError("store timeout")
            return self.s.check(keys)

        def delete_key(self, key):
            return self.s.delete_key(key)

    first, first_keys = _round(store, "i")
    done, keys = _round(store, "j")
    leftovers.remember(first, first_keys, time.monotonic() - 1, 0)
    leftovers.remember(done, keys, time.monotonic() - 1, 0)
    assert leftovers.reap(FailsOnce(store), 0) == 1
    assert store.check([first]) and not any(store.check([k]) for k in keys)
    assert leftovers.pending() == 0
