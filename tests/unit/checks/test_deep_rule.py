"""Modes 7, 8, 9 (opt-in deep probe): where it applies, the handle type it exports, and
one rank's rule over the exchange its context brings (``ctx.extra["exchange"]``, a real
``checks.exchange.Exchange`` on a real in-memory ``HashStore``), with the peer's side
written by the test as a peer would write it. The simulated device stands behind the probe
interface (export and import of handles), given as ``ctx.extra["prober"]``. The exchange's
own logic is ``tests/unit/agreement/test_exchange.py``."""

from __future__ import annotations

import json
import time

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.agreement import store as _store
from flashinfer_safe_workspace.checks.exchange import Exchange
from flashinfer_safe_workspace.checks import deep
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
from unit.facts import ctx, fabric, settings

ON = settings(deep_probe=True)


@pytest.mark.parametrize("version,backend,entry,kind,sett,fh,expected", [
    ("0.7.2", "trtllm", "unified", "store", ON, False, "posix"),
    ("0.7.2", "trtllm", "unified", "store", ON, True, "fabric"),
    ("0.7.4", "trtllm", "unified", "store", ON, False, "posix"),  # B4 votes: POSIX on one host
    ("0.7.2", "trtllm", "unified", "store", settings(), False, None),  # opt-in
    ("0.7.2", "trtllm", "unified", "allgather", ON, False, None),  # a comm backend's group
    ("0.6.10", "trtllm", "unified", "store", ON, False, None),  # torch symmetric memory
    ("0.6.9", "trtllm", "legacy", "store", ON, False, None),  # cudaIpc: not written
])
def test_deep_applies(version, backend, entry, kind, sett, fh, expected):
    """Settings without ``deep_probe`` leave it off."""
    c = ctx(backend, version, entry=entry, kind=kind, sett=sett, fabric_handles=fh,
            fabric=fabric())
    assert deep.applies(c) is (expected is not None)
    import types

    assert not deep.applies(ctx(backend, version, entry=entry, kind=kind, fabric_handles=fh,
                                fabric=fabric(), sett=types.SimpleNamespace()))
    if expected is not None:
        assert deep._handle(c) == expected


PREFIX = "fiws/0/0-1/0/"  # the round's keys
BASE = PREFIX + "x/deep"
LONG = 30.0


@pytest.fixture
def hashstore():
    import torch.distributed as dist

    return dist.HashStore()


def deep_ctx(store, dev=None, until=None, line=None, **kw):
    """A context with this round's exchange (under ``PREFIX``) on ``store`` and the prober;
    ``until``: the round's bound (by default one never reached)."""
    c = ctx("trtllm", "0.7.2", sett=ON, **kw)
    until = time.monotonic() + LONG if until is None else until
    line = line or _store.StoreLine(lambda: store)
    c.extra["exchange"] = Exchange(line, PREFIX, "deep", c.members.ranks, c.members.me, until)
    c.extra["prober"] = dev
    return c


def passed():
    return time.monotonic() - 1.0  # a bound already behind: one look, then stop


def peer_writes(store, token, done=True, pos=1):
    store.set(f"{BASE}/v/{pos}", json.dumps(token))
    if done:
        store.set(f"{BASE}/d/{pos}", "1")


def mine(store, pos=0) -> dict:
    return json.loads(store.get(f"{BASE}/v/{pos}"))


def test_a_peer_that_imports_and_is_imported(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev)
    peer_writes(hashstore, {"sim": "posix", "pid": 1, "refuse": False, "host": "h1/boot"})
    assert deep.run(c, True) == checks.base.ok("handle=posix")
    assert (dev.imports, dev.exports_live) == (1, 0)
    assert mine(hashstore)["host"] == "h1/boot" and mine(hashstore)["sim"] == "posix"
    assert hashstore.get(f"{BASE}/d/0") == b"1"
    assert int(hashstore.add(f"{BASE}/n", 0)) == 1  # one of the two through: keys kept
    assert deep.keys_of_last_run() == tuple(
        [f"{BASE}/v/0", f"{BASE}/v/1", f"{BASE}/d/0", f"{BASE}/d/1", f"{BASE}/n"])


def test_without_an_exchange_or_a_prober_the_check_fails(hashstore):
    for missing in ("exchange", "prober"):
        c = deep_ctx(hashstore, SimulatedDevice(1 << 30))
        del c.extra[missing]
        assert deep.run(c, True) == checks.base.fail(
            R.DEEP_PROBE_FAILED, "handle=posix", "no round to exchange handles in")
    c = deep_ctx(hashstore, None)
    assert deep.run(c, False).value == "handle=-"


def test_an_import_that_fails_names_the_peer(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev)
    peer_writes(hashstore, {"sim": "posix", "refuse": True, "host": "h1/boot"})
    res = deep.run(c, True)
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == ("import failed from rank 1: RuntimeError: simulated import failure: "
                        "CUDA_ERROR_INVALID_DEVICE")
    assert dev.exports_live == 0


def test_peers_on_other_hosts_or_skipping_are_not_imported(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, world=3)
    peer_writes(hashstore, {"sim": "posix", "refuse": True, "host": "h2/boot"}, pos=1)
    peer_writes(hashstore, {"skip": True, "host": "h1/boot"}, done=False, pos=2)
    assert deep.run(c, True) == checks.base.ok("handle=posix")
    assert dev.imports == 0
    assert int(hashstore.add(f"{BASE}/n", 0)) == 1  # rank 1 took part: not the last


def test_the_last_taker_deletes_the_keys(hashstore):
    c = deep_ctx(hashstore, SimulatedDevice(1 << 30))
    peer_writes(hashstore, {"skip": True, "host": "h1/boot"}, done=False)
    assert deep.run(c, True).ok
    assert not any(hashstore.check([k]) for k in deep.keys_of_last_run())


def test_a_rank_not_taking_part_publishes_skip(hashstore):
    dev = SimulatedDevice(1 << 30)
    assert deep.run(deep_ctx(hashstore, dev), False) is None
    assert mine(hashstore) == {"skip": True, "host": "h1/boot"}
    assert dev.exports_live == 0 and dev.imports == 0


def test_unreadable_facts_publish_an_unknown_host(hashstore):
    assert deep.run(deep_ctx(hashstore, SimulatedDevice(1 << 30), facts=False), False) is None
    assert mine(hashstore) == {"skip": True, "host": "?"}


def test_an_export_that_fails(hashstore):
    dev = SimulatedDevice(1 << 30, export_error="no fd")
    res = deep.run(deep_ctx(hashstore, dev), True)
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == "export failed: RuntimeError: simulated export failure: no fd"
    assert mine(hashstore)["skip"] is True and dev.exports_live == 0


def test_a_peer_that_never_publishes_is_not_this_rank_s_failure(hashstore):
    """At the round's bound a peer that never published is named, without a no: the vote
    that follows names it absent (a missing peer is not an import failure)."""
    dev = SimulatedDevice(1 << 30)
    res = deep.run(deep_ctx(hashstore, dev, until=passed()), True)
    assert (res.ok, res.applies, res.code, res.value) == (True, False, R.DEEP_PROBE_FAILED,
                                                         "handle=posix")
    assert res.note == ("not run to its end: ranks [1] published no handle before the round's "
                        "bound")
    assert dev.exports_live == 0


def test_a_peer_that_never_finishes_importing_is_named_without_a_no(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, until=passed())
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, done=False)
    res = deep.run(c, True)
    assert (res.ok, res.applies) == (True, False)
    assert res.note == "not run to its end: ranks [1] did not finish importing before the round's bound"
    assert dev.exports_live == 0


def test_a_rank_that_comes_after_its_round_was_decided_does_not_probe(hashstore):
    """It reads the register first: the vote follows it, and nothing is exported."""
    dev = SimulatedDevice(1 << 30)
    hashstore.set(PREFIX + "d", "abort|{}")
    res = deep.run(deep_ctx(hashstore, dev), True)
    assert (res.ok, res.applies) == (True, False)
    assert res.note == "not run to its end: the round was decided before this rank's probe"
    assert dev.exports_live == 0 and not hashstore.check([f"{BASE}/v/0"])


def test_a_register_written_while_it_waits_ends_the_probe(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev)  # a bound never reached

    ex = c.extra["exchange"]
    real = ex.publish

    def publish_then_a_peer_aborts(value):
        real(value)
        hashstore.set(PREFIX + "d", "abort|{}")
    ex.publish = publish_then_a_peer_aborts
    res = deep.run(c, True)
    assert (res.ok, res.applies) == (True, False)
    assert res.note == "not run to its end: the round was decided while it waited"
    assert dev.exports_live == 0


class Recording:
    """The store line, recording the deadline of every call."""

    def __init__(self, line):
        self.line, self.deadlines = line, []

    def call(self, fn, deadline):
        self.deadlines.append(deadline)
        return self.line.call(fn, deadline)


def test_the_round_trip_is_bounded_by_the_round(hashstore):
    line = Recording(_store.StoreLine(lambda: hashstore))
    until = time.monotonic() + LONG
    c = deep_ctx(hashstore, SimulatedDevice(1 << 30), until=until, line=line)
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"})
    assert deep.run(c, True).ok
    # every call is bounded by the round's bound, with the exchange's small grace for the
    # one operation always tried
    assert line.deadlines and set(line.deadlines) == {until + 0.2}


def test_long_errors_are_cut(hashstore):
    class Refusing(SimulatedDevice):
        def import_handle(self, handle, token, device=None):
            raise RuntimeError("i" * 300)

    c = deep_ctx(hashstore, Refusing(1 << 30), world=3)
    for pos in (1, 2):
        peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, pos=pos)
    res = deep.run(c, True)
    one = ("from rank 1: RuntimeError: " + "i" * 300)[:160]
    assert res.note == ("import failed " + one + "; " + one.replace("rank 1", "rank 2"))[:300]
    res = deep.run(deep_ctx(hashstore, SimulatedDevice(1 << 30, export_error="e" * 300)), True)
    assert res.note == "export failed: " + ("RuntimeError: simulated export failure: " + "e" * 300)[:200]


def test_only_the_peer_that_never_publishes_is_named(hashstore):
    """Of two peers, the one that published is not named missing."""
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, until=passed(), world=3)
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, pos=1)
    res = deep.run(c, True)
    assert res.note == "not run to its end: ranks [2] published no handle before the round's bound"
    assert dev.exports_live == 0


def test_a_skipping_peer_does_not_stop_the_imports_of_the_next(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, world=3)
    peer_writes(hashstore, {"skip": True, "host": "h1/boot"}, done=False, pos=1)
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, pos=2)
    assert deep.run(c, True).ok and dev.imports == 1


def test_the_export_released_is_the_one_exported(hashstore):
    class Keeping(SimulatedDevice):
        released: list = []

        def release_export(self, keep):
            self.released.append(keep)
            super().release_export(keep)

    dev = Keeping(1 << 30)
    c = deep_ctx(hashstore, dev)
    peer_writes(hashstore, {"skip": True, "host": "h1/boot"}, done=False)
    assert deep.run(c, True).ok
    assert len(dev.released) == 1 and dev.released[0]["sim"] == "posix"
