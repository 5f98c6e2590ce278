"""Whether a record's writer still runs (``agreement/process``): real processes of this
machine, started and ended here; ``/proc`` as Linux gives it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flashinfer_safe_workspace.agreement import process as P

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

LONG = 30.0


def _ident_of(pid: int) -> str:
    boot, ns, _ = P.identity().split("/")
    return f"{boot}/{ns}/{P._start_ticks(pid)}"


def test_this_process_has_a_boot_a_namespace_and_a_start():
    boot, ns, start = P.identity().split("/")
    assert len(boot) >= 32 and ns.isdigit() and start.isdigit()
    assert not P.gone(os.getpid(), P.identity())


def test_a_live_process_is_not_gone_and_an_ended_one_is():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    ident = _ident_of(child.pid)
    assert not P.gone(child.pid, ident)
    child.stdin.close()
    child.wait(LONG)  # reaped: no such pid
    assert P.gone(child.pid, ident)


def test_an_ended_process_not_yet_reaped_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    ident = _ident_of(child.pid)
    child.stdin.close()
    for _ in range(int(LONG / 0.01)):  # a zombie until we reap it
        if P._read(f"/proc/{child.pid}/stat").split(") ")[1].startswith("Z"):
            break
        time.sleep(0.01)
    assert P.gone(child.pid, ident)
    child.wait(LONG)


def test_a_pid_that_runs_another_process_is_gone():
    parent = os.getppid()
    boot, ns, start = _ident_of(parent).split("/")
    assert P.gone(parent, f"{boot}/{ns}/{int(start) + 1}")  # the pid was reused


def test_where_it_cannot_tell_the_record_stands():
    boot, ns, start = P.identity().split("/")
    dead = 2 ** 22 + 12345  # above any pid_max: no such process here
    assert P.gone(dead, f"{boot}/{ns}/1")
    assert not P.gone(dead, f"another-boot/{ns}/1")  # another host
    assert not P.gone(dead, f"{boot}/1/1")  # another pid namespace
    assert not P.gone(dead, "")  # an identity that could not be read
