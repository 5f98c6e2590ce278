"""The exchange of values among one round's ranks (``checks/exchange``), used by the deep
probe: keys under the round's prefix, publish and gather, done and wait_done, the stop when
the round's register is written, and the last taker's cleanup, over a real in-memory
``HashStore`` (each rank its own store line, as processes would). No test allows a span of
time: a wait that must end does so on a bound already passed (one look, then it stops), or
on the register; one that must not has a bound never reached."""

from __future__ import annotations

import time

import pytest

from flashinfer_safe_workspace.agreement import store as _store
from flashinfer_safe_workspace.checks import exchange as _exchange
from flashinfer_safe_workspace.checks.exchange import Exchange

PREFIX = "fiws/0/4-5-6/3/"
LONG = 30.0


@pytest.fixture
def hashstore():
    import torch.distributed as dist

    return dist.HashStore()


class Inline:
    """A store line that runs each operation on the calling thread: the look at a bound
    already passed is then taken whatever the machine's load (a real line's thread gets
    GRACE_S for it, a span of time no test here relies on)."""

    def __init__(self, store):
        self.store = store

    def call(self, fn, deadline):
        return fn(self.store)


def at(store, me, ranks=(4, 5, 6), prefix=PREFIX, until=None):
    if until is not None:  # a bound already passed: the look runs inline
        return Exchange(Inline(store), prefix, "deep", ranks, me, until)
    return Exchange(_store.StoreLine(lambda: store), prefix, "deep", ranks, me,
                    time.monotonic() + LONG)


def passed():
    return time.monotonic() - 1.0  # a bound already behind us: one look, then stop


def test_keys_are_under_the_round_s_prefix(hashstore):
    ex = at(hashstore, 1, ranks=(4, 5))
    b = PREFIX + "x/deep"
    assert ex.keys() == (f"{b}/v/0", f"{b}/v/1", f"{b}/d/0", f"{b}/d/1", f"{b}/n")
    assert ex.peers() == [0]
    assert at(hashstore, 0, prefix="fiws/0/4-5-6/4/").keys() != at(hashstore, 0).keys()


def test_every_rank_gathers_its_peers_values(hashstore):
    a, b, c = (at(hashstore, p) for p in range(3))
    for ex, v in ((a, {"x": 0}), (b, {"x": 1}), (c, {"x": 2})):
        ex.publish(v)
    assert a.gather() == ({1: {"x": 1}, 2: {"x": 2}}, [])
    assert c.gather() == ({0: {"x": 0}, 1: {"x": 1}}, [])
    assert (a.stopped, c.stopped) == ("", "")


def test_a_peer_that_never_publishes_is_missing_at_the_bound(hashstore):
    at(hashstore, 1).publish({"x": 1})
    a = at(hashstore, 0, until=passed())
    assert a.gather() == ({1: {"x": 1}}, [2])  # what one look found
    assert a.stopped == ""  # the bound ended it, not a register


def test_a_written_register_ends_the_wait_at_once(hashstore):
    hashstore.set(PREFIX + "d", "abort|{}")  # a peer said no, or gave up
    a = at(hashstore, 0)  # a bound never reached
    assert a.decided()
    assert a.gather() == ({}, [1, 2]) and a.stopped == "decided"


def test_wait_done_names_the_positions_not_done(hashstore):
    at(hashstore, 1).done()
    assert at(hashstore, 0, until=passed()).wait_done([1, 2]) == [2]
    at(hashstore, 2).done()
    assert at(hashstore, 0).wait_done([1, 2]) == []


def test_the_last_taker_removes_every_key(hashstore):
    a, b = at(hashstore, 0, ranks=(4, 5)), at(hashstore, 1, ranks=(4, 5))
    a.publish({"x": 0})
    b.publish({"x": 1})
    a.done()
    b.done()
    a.finish(2)
    assert any(hashstore.check([k]) for k in a.keys())  # b has not counted through yet
    b.finish(2)
    assert not any(hashstore.check([k]) for k in a.keys())


class Failing:
    def __getattr__(self, name):
        def fail(*a, **k):
            raise RuntimeError("store down")
        return fail


def test_a_store_that_fails_in_cleanup_is_not_an_error():
    Exchange(_store.StoreLine(Failing), PREFIX, "deep", (0, 1), 0, time.monotonic() + LONG).finish(2)


def test_for_round_uses_this_process_store_line(hashstore, monkeypatch):
    line, asked = _store.StoreLine(lambda: hashstore), []
    monkeypatch.setattr(_store, "line", lambda timeout: asked.append(timeout) or line)
    until = time.monotonic() + LONG
    ex = _exchange.for_round(PREFIX, "deep", (0, 1), 1, 7.5, until)
    assert (ex.line, ex.me, ex.until, asked) == (line, 1, until, [7.5])
    assert ex.base == PREFIX + "x/deep"
