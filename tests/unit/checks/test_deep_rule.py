"""Modes 7, 8, 9 (opt-in deep probe): where it applies, the handle type it exports, and
one rank's rule over the exchange its context brings (``ctx.extra["exchange"]``, a real
``agreement.exchange.Exchange`` on a real in-memory ``HashStore``), with the peer's side
written by the test as a peer would write it. The simulated device stands behind the probe
interface (export and import of handles), given as ``ctx.extra["prober"]``. The exchange's
own logic is ``tests/unit/agreement/test_exchange.py``."""

from __future__ import annotations

import json

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.agreement import store as _store
from flashinfer_safe_workspace.agreement.exchange import Exchange
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


BASE = "fiws-x/r0/deep"


@pytest.fixture
def hashstore():
    import torch.distributed as dist

    return dist.HashStore()


def deep_ctx(store, dev=None, left_s=5.0, line=None, **kw):
    """A context with this round's exchange (keyed ``r0``) on ``store`` and the prober."""
    c = ctx("trtllm", "0.7.2", sett=ON, **kw)
    c.extra["left_s"] = left_s
    line = line or _store.StoreLine(lambda: store)
    c.extra["exchange"] = Exchange(line, "r0", "deep", c.members.ranks, c.members.me)
    c.extra["prober"] = dev
    return c


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


def test_a_peer_that_never_publishes_ends_at_the_bound(hashstore):
    dev = SimulatedDevice(1 << 30)
    res = deep.run(deep_ctx(hashstore, dev, left_s=0.1), True)  # bound: half what is left
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == ("ranks [1] published no handle in this round's deep probe before "
                        "its bound (half the time left)")
    assert dev.exports_live == 0


def test_a_peer_that_never_finishes_importing_is_named(hashstore):
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, left_s=0.1)
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, done=False)
    res = deep.run(c, True)
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == "ranks [1] did not finish importing before the bound"
    assert dev.exports_live == 0


class Recording:
    """The store line, recording the deadline of every call."""

    def __init__(self, line):
        self.line, self.deadlines = line, []

    def call(self, fn, deadline):
        self.deadlines.append(deadline)
        return self.line.call(fn, deadline)


@pytest.mark.parametrize("left,bound", [(None, 0.5), (5.0, 2.5), (0.04, 0.05)])
def test_the_round_trip_is_bounded_by_half_of_what_is_left(hashstore, monkeypatch, left, bound):
    import time as _time

    line = Recording(_store.StoreLine(lambda: hashstore))
    start = _time.monotonic()
    monkeypatch.setattr(deep, "time", type("Clock", (), {
        "monotonic": staticmethod(lambda: start), "sleep": staticmethod(_time.sleep)}))
    c = deep_ctx(hashstore, SimulatedDevice(1 << 30), line=line)
    if left is None:
        del c.extra["left_s"]
    else:
        c.extra["left_s"] = left
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"})
    assert deep.run(c, True).ok
    # every call is bounded by the check's deadline; the read of values found present gets
    # the exchange's small grace over it
    assert line.deadlines and min(line.deadlines) == start + bound
    assert set(line.deadlines) <= {start + bound, start + bound + 0.2}


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
    """Of two peers, the one that published is not named missing (a poll cut short by the
    bound used to drop what the polls before it had found)."""
    dev = SimulatedDevice(1 << 30)
    c = deep_ctx(hashstore, dev, left_s=0.1, world=3)
    peer_writes(hashstore, {"sim": "posix", "host": "h1/boot"}, pos=1)
    res = deep.run(c, True)
    assert res.note == ("ranks [2] published no handle in this round's deep probe before "
                        "its bound (half the time left)")
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
