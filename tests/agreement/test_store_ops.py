"""The agreement's one-operation reads and waits (agreement/ops.py) on a real c10d TCPStore."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from flashinfer_safe_workspace.agreement import ops

BOUND_S = 5.0


_servers: list = []  # kept for the module's life: a collected server closes its clients


def _store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    _servers.append(server)
    return server, server.clone(), server.clone()


def test_get_if_reads_without_writing():
    _, a, _ = _store()
    assert ops.get_if(a, "k") is None
    assert not a.check(["k"])  # the read left nothing behind
    a.set("k", "v")
    assert ops.get_if(a, "k") == b"v"


def test_wait_get_outlasts_a_peer_reading_the_missing_key():
    """A peer's one-op read (compare_set) of the key we wait for wakes our blocking get
    with an empty answer: the wait must go on, and return the value written later."""
    _, waiting, peer = _store()
    got = {}

    def wait():
        got["value"] = ops.wait_get(waiting, "ready", time.monotonic() + BOUND_S)
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    assert ops.get_if(peer, "ready") is None  # the poll that used to end the wait early
    time.sleep(0.2)
    assert t.is_alive(), got  # still waiting
    peer.set("ready", "propose")
    t.join(BOUND_S)
    assert got.get("value") == b"propose"


def test_wait_get_gives_up_at_its_bound():
    _, waiting, _ = _store()
    start = time.monotonic()
    assert ops.wait_get(waiting, "never", start + 0.3) is None
    assert time.monotonic() - start < BOUND_S
    waiting.set("after", "1")  # the connection still works, with its own timeout back
    assert waiting.get("after") == b"1"
