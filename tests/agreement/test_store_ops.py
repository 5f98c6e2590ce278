"""What the checker's model assumes of the c10d store (tests/model/system.py), on a real
TCPStore of the installed torch (libuv server, clients in this process), one operation at
a time; and the driver's operations (``agreement/driver._execute``) on it. If a torch
release changed any of these, the model would no longer be the store, and this file says
which assumption broke."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from flashinfer_safe_workspace.agreement import core as C, driver as D

BOUND_S = 10.0

_servers: list = []  # kept for the module's life: a collected server closes its clients


def _store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    _servers.append(server)
    return server.clone(), server.clone(), server.clone()


def _waiting(store, key):
    """A thread blocked in ``wait([key])``; its list gets "woken" when the wait returns."""
    woken: list = []

    def wait():
        store.wait([key], datetime.timedelta(seconds=BOUND_S))
        woken.append(True)
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, woken


def _until_waiting(t):
    time.sleep(0.2)  # the wait request reaches the server (if not, the assertions below still hold)
    assert t.is_alive()


def test_compare_set_writes_a_missing_key_only_when_it_expects_nothing():
    a, _, _ = _store()
    assert a.compare_set("d", "", "first") == b"first"
    assert a.compare_set("d", "", "second") == b"first"  # the first write wins
    assert a.compare_set("missing", "x", "y") == b"x" and not a.check(["missing"])  # "lying"


def test_a_compare_set_read_of_a_missing_key_wakes_its_waiter():
    """The model's ``get`` wakes the key's waiters: a woken rank reads no register."""
    a, b, _ = _store()
    t, woken = _waiting(a, "d")
    _until_waiting(t)
    assert D._get_if(b, "d") is None
    t.join(BOUND_S)
    assert woken == [True] and not b.check(["d"])


def test_check_and_delete_wake_nobody():
    a, b, _ = _store()
    t, woken = _waiting(a, "d")
    _until_waiting(t)
    assert b.check(["d"]) is False
    b.set("other", "x")
    b.delete_key("d")
    time.sleep(0.2)
    assert t.is_alive() and woken == []
    b.compare_set("d", "", "abort")  # the register written: the waiter goes
    t.join(BOUND_S)
    assert woken == [True]


def test_append_is_ordered_before_the_next_request_of_its_connection():
    a, b, _ = _store()
    for i in range(50):
        a.append("r", f"{i}\n")
        assert a.add("n", 1) == i + 1
        assert b.get("r").decode().split("\n")[i] == str(i)  # applied before the add's reply


def test_a_wait_on_a_present_key_returns_at_once_and_add_returns_the_count():
    a, _, _ = _store()
    a.set("k", "v")
    a.wait(["k"], datetime.timedelta(seconds=BOUND_S))
    assert a.add("n", 1) == 1 and a.add("n", 0) == 1


def test_the_driver_s_operations_on_a_tcpstore():
    a, b, c = _store()
    until = time.monotonic() + BOUND_S
    t, woken = _waiting(c, "x")  # another client's wait on another key is not touched
    D._execute(b, C.Op("append", "p/r", "0 y c\t{}\n"), until)
    assert D._execute(b, C.Op("add", "p/n", n=1), until) == 1
    assert D._execute(b, C.Op("get", "p/r"), until) == b"0 y c\t{}\n"
    assert D._execute(b, C.Op("cas", "p/d", "commit|{}"), until) == b"commit|{}"
    assert D._execute(b, C.Op("check", "p/d"), until) is True
    assert D._execute(a, C.Op("wait", "p/d"), until) is None
    for k in C.KEYS:
        D._execute(b, C.Op("delete", "p/" + k), until)
    assert not any(b.check(["p/" + k]) for k in C.KEYS)
    b.set("x", "1")
    t.join(BOUND_S)
    assert woken == [True]
