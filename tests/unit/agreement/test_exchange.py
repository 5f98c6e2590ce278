"""The exchange of values among one round's ranks (``agreement/exchange``), used by the deep
probe: key names keyed by the round, publish and gather, done and wait_done, and the last
taker's cleanup, over a real in-memory ``HashStore`` (each rank its own store line, as
processes would). Waits are bounded by the deadline each test gives."""

from __future__ import annotations

import time

import pytest

from flashinfer_safe_workspace.agreement import exchange as _exchange, store as _store
from flashinfer_safe_workspace.agreement.exchange import Exchange


@pytest.fixture
def hashstore():
    import torch.distributed as dist

    return dist.HashStore()


def at(store, me, ranks=(4, 5, 6), key="0,1/c/0"):
    return Exchange(_store.StoreLine(lambda: store), key, "deep", ranks, me)


def soon(s=5.0):
    return time.monotonic() + s


def test_keys_are_named_after_the_round_and_the_exchange(hashstore):
    ex = at(hashstore, 1, ranks=(4, 5))
    b = "fiws-x/0,1/c/0/deep"
    assert ex.keys() == (f"{b}/v/0", f"{b}/v/1", f"{b}/d/0", f"{b}/d/1", f"{b}/n")
    assert ex.peers() == [0]
    assert at(hashstore, 0, key="0,1/c/1").keys() != at(hashstore, 0).keys()  # next round


def test_every_rank_gathers_its_peers_values(hashstore):
    a, b, c = (at(hashstore, p) for p in range(3))
    for ex, v in ((a, {"x": 0}), (b, {"x": 1}), (c, {"x": 2})):
        ex.publish(v, soon())
    assert a.gather(soon()) == ({1: {"x": 1}, 2: {"x": 2}}, [])
    assert c.gather(soon()) == ({0: {"x": 0}, 1: {"x": 1}}, [])


def test_a_peer_that_never_publishes_is_missing_at_the_deadline(hashstore):
    a, b = at(hashstore, 0), at(hashstore, 1)
    b.publish({"x": 1}, soon())
    start = time.monotonic()
    assert a.gather(start + 0.1) == ({1: {"x": 1}}, [2])
    assert time.monotonic() - start >= 0.1  # it waited for the missing one up to the bound
    assert at(hashstore, 1).gather(soon(0.05)) == ({}, [0, 2])  # nobody else: nothing read


def test_wait_done_names_the_positions_not_done(hashstore):
    a, b, c = (at(hashstore, p) for p in range(3))
    b.done(soon())
    assert a.wait_done([1, 2], soon(0.1)) == [2]
    c.done(soon())
    assert a.wait_done([1, 2], soon()) == []
    assert a.wait_done([], soon()) == []


def test_the_last_taker_removes_every_key(hashstore):
    a, b = at(hashstore, 0, ranks=(0, 1)), at(hashstore, 1, ranks=(0, 1))
    for ex in (a, b):
        ex.publish({"v": ex.me}, soon())
        ex.done(soon())
    a.finish(2, soon())
    assert all(hashstore.check([k]) for k in a.keys()[:-1])  # one of two through: kept
    b.finish(2, soon())
    assert not any(hashstore.check([k]) for k in a.keys())


def test_a_store_that_fails_in_cleanup_is_not_an_error(hashstore):
    class Broken:
        def call(self, fn, deadline):
            raise _store.StoreTimeout("no answer")

    ex = Exchange(Broken(), "r", "deep", (0, 1), 0)
    ex.finish(1, soon())  # best effort: no exception
    assert ex.gather(soon(0.02)) == ({}, [1])  # a store that never answers: nothing found


def test_for_round_uses_this_process_store_line(hashstore, monkeypatch):
    line = _store.StoreLine(lambda: hashstore)
    asked = []
    monkeypatch.setattr(_store, "line", lambda timeout: asked.append(timeout) or line)
    ex = _exchange.for_round("0,1/c/2", "deep", (0, 1), 1, 7.5)
    assert (ex.line, ex.ranks, ex.me, asked) == (line, (0, 1), 1, [7.5])
    assert ex.keys()[0] == "fiws-x/0,1/c/2/deep/v/0"
