"""Modes 7, 8, 9 (opt-in deep probe): where it applies, the handle type it exports, and
one rank's round trip through a real in-memory ``HashStore`` (the store line pointed at
it), with the peer's side written by the test as a peer would write it. The simulated
device stands behind the probe interface (export and import of handles)."""

from __future__ import annotations

import json

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.agreement import store as _store
from flashinfer_safe_workspace.agreement.vote import members_key
from flashinfer_safe_workspace.checks import deep
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.request import identity
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


@pytest.fixture
def hashstore(monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()
    line = _store.StoreLine(lambda: store)
    monkeypatch.setattr(_store, "line", lambda timeout: line)
    return store


def deep_ctx(left_s=5.0, **kw):
    c = ctx("trtllm", "0.7.2", sett=ON, **kw)
    c.extra["left_s"] = left_s
    return c


def base_of(c) -> str:
    """The round's key prefix this rank will use (the per-call count before the run)."""
    n = deep._counts.get((c.members.ranks, identity(c.req)), 0)
    return f"fiws-deep/{members_key(c.members.ranks)}/{identity(c.req)}/{n}"


def peer_writes(store, base, token, done=True, pos=1):
    store.set(f"{base}/h/{pos}", json.dumps(token))
    if done:
        store.set(f"{base}/d/{pos}", "1")


def device(**sim):
    dev = SimulatedDevice(1 << 30, **sim)
    _probe.set_prober(dev)
    return dev


def mine(store, base, pos=0) -> dict:
    return json.loads(store.get(f"{base}/h/{pos}"))


def test_a_peer_that_imports_and_is_imported(hashstore):
    dev = device()
    c = deep_ctx()
    base = base_of(c)
    peer_writes(hashstore, base, {"sim": "posix", "pid": 1, "refuse": False, "host": "h1/boot"})
    assert deep.run(c, True) == checks.base.ok("handle=posix")
    assert (dev.imports, dev.exports_live) == (1, 0)
    assert mine(hashstore, base)["host"] == "h1/boot" and mine(hashstore, base)["sim"] == "posix"
    assert hashstore.get(f"{base}/d/0") == b"1"
    assert int(hashstore.add(f"{base}/n", 0)) == 1  # one of the two through: keys kept
    assert deep.keys_of_last_run() == tuple(
        [f"{base}/h/0", f"{base}/h/1", f"{base}/d/0", f"{base}/d/1", f"{base}/n"])
    assert base_of(c) != base  # the next call of this rank set counts on


def test_an_import_that_fails_names_the_peer(hashstore):
    dev = device()
    c = deep_ctx()
    base = base_of(c)
    peer_writes(hashstore, base, {"sim": "posix", "refuse": True, "host": "h1/boot"})
    res = deep.run(c, True)
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == ("import failed from rank 1: RuntimeError: simulated import failure: "
                        "CUDA_ERROR_INVALID_DEVICE")
    assert dev.exports_live == 0


def test_peers_on_other_hosts_or_skipping_are_not_imported(hashstore):
    dev = device()
    c = deep_ctx(world=3)
    base = base_of(c)
    peer_writes(hashstore, base, {"sim": "posix", "refuse": True, "host": "h2/boot"}, pos=1)
    peer_writes(hashstore, base, {"skip": True, "host": "h1/boot"}, done=False, pos=2)
    assert deep.run(c, True) == checks.base.ok("handle=posix")
    assert dev.imports == 0
    assert int(hashstore.add(f"{base}/n", 0)) == 1  # rank 1 took part: not the last


def test_the_last_taker_deletes_the_keys(hashstore):
    device()
    c = deep_ctx()
    base = base_of(c)
    peer_writes(hashstore, base, {"skip": True, "host": "h1/boot"}, done=False)
    assert deep.run(c, True).ok
    assert not any(hashstore.check([k]) for k in deep.keys_of_last_run())


def test_a_rank_not_taking_part_publishes_skip(hashstore):
    dev = device()
    c = deep_ctx()
    base = base_of(c)
    assert deep.run(c, False) is None
    assert mine(hashstore, base) == {"skip": True, "host": "h1/boot"}
    assert dev.exports_live == 0 and dev.imports == 0


def test_unreadable_facts_publish_an_unknown_host(hashstore):
    device()
    c = deep_ctx(facts=False)
    base = base_of(c)
    assert deep.run(c, False) is None
    assert mine(hashstore, base) == {"skip": True, "host": "?"}


def test_an_export_that_fails(hashstore):
    dev = device(export_error="no fd")
    c = deep_ctx()
    base = base_of(c)
    res = deep.run(c, True)
    assert (res.ok, res.code, res.value) == (False, R.DEEP_PROBE_FAILED, "handle=posix")
    assert res.note == "export failed: RuntimeError: simulated export failure: no fd"
    assert mine(hashstore, base)["skip"] is True and dev.exports_live == 0


def test_a_peer_that_never_publishes_ends_at_the_bound(hashstore):
    dev = device()
    res = deep.run(deep_ctx(left_s=0.1), True)  # bound: half of what is left (0.05 s)
    assert (res.ok, res.code) == (False, R.DEEP_PROBE_FAILED)
    # the bound ends either the poll (TimeoutError) or a store call (StoreTimeout)
    assert res.note in ("round trip not done in time: peers did not publish in time",
                        "round trip not done in time: the c10d store did not answer in time")
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

    line = Recording(_store.line(10.0))
    monkeypatch.setattr(_store, "line", lambda timeout: line)
    start = _time.monotonic()
    monkeypatch.setattr(deep, "time", type("Clock", (), {
        "monotonic": staticmethod(lambda: start), "sleep": staticmethod(_time.sleep)}))
    device()
    c = deep_ctx()
    if left is None:
        del c.extra["left_s"]
    else:
        c.extra["left_s"] = left
    base = base_of(c)
    peer_writes(hashstore, base, {"sim": "posix", "host": "h1/boot"})
    assert deep.run(c, True).ok
    assert line.deadlines and set(line.deadlines) == {start + bound}


def test_long_errors_are_cut(hashstore):
    class Refusing(SimulatedDevice):
        def import_handle(self, handle, token, device=None):
            raise RuntimeError("i" * 300)

    _probe.set_prober(Refusing(1 << 30))
    c = deep_ctx(world=3)
    base = base_of(c)
    for pos in (1, 2):
        peer_writes(hashstore, base, {"sim": "posix", "host": "h1/boot"}, pos=pos)
    res = deep.run(c, True)
    one = ("from rank 1: RuntimeError: " + "i" * 300)[:160]
    assert res.note == ("import failed " + one + "; " + one.replace("rank 1", "rank 2"))[:300]
    device(export_error="e" * 300)
    res = deep.run(deep_ctx(), True)
    assert res.note == "export failed: " + ("RuntimeError: simulated export failure: " + "e" * 300)[:200]
