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


def test_a_proc_of_another_pid_namespace_is_not_read():
    """Issue 29's re-review (M1): in a pid namespace whose ``/proc`` is another one's (a
    container given the host's ``/proc``; here ``unshare --pid`` without a new mount), pid 2
    of this namespace is another process in ``/proc``: a live peer's record was "gone" and
    vetoed. Where ``/proc/self`` is not this pid, it cannot tell."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    code = ("import subprocess, sys\n"
            "from flashinfer_safe_workspace.agreement import process as P\n"
            "peer = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
            " stdin=subprocess.PIPE)\n"
            "boot, ns, start = P.identity().split('/')\n"
            "print(P._own_proc(), P.gone(peer.pid, f'{boot}/{ns}/{start}'), flush=True)\n"
            "peer.stdin.close(); peer.wait(30)\n")
    run = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=LONG)
    if run.returncode != 0 and "unshare" in run.stderr:
        pytest.skip(f"unshare --pid is not allowed here: {run.stderr.strip()[:120]}")
    assert run.stdout.split() == ["False", "False"], (run.stdout, run.stderr)
    assert P._own_proc()  # this process's /proc is its own


def test_a_pid_hidden_from_proc_but_running_is_not_gone(monkeypatch):
    """Issue 29's re-review (M1): with ``/proc`` mounted ``hidepid=2``, another user's
    process has no ``/proc/<pid>``: its record was "gone". A pid that signal 0 finds runs;
    one it does not find is gone."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    ident = _ident_of(child.pid)

    def hidden(pid):
        raise FileNotFoundError(f"/proc/{pid}/stat")
    monkeypatch.setattr(P, "_start_ticks", hidden)
    assert not P.gone(child.pid, ident)
    child.stdin.close()
    child.wait(LONG)
    assert P.gone(child.pid, ident)


def test_a_record_whose_time_is_not_a_number_stands():
    """Issue 29's re-review (m1): a record with a time that is no number (another writer's
    bug) raised out of the count's completion; it is taken as it is."""
    import dataclasses

    from flashinfer_safe_workspace.agreement import vote
    from unit.facts import record

    odd = dataclasses.replace(record(1), at="yesterday", proc=P.identity())
    assert vote._gone([record(0), odd]) == []
    old = dataclasses.replace(record(1), at=1.0, proc=P.identity(), pid=2 ** 22 + 12345)
    assert vote._gone([odd, old]) == [1]  # the next record is still looked at
