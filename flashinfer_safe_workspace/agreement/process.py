"""Whether a record's writer still runs: a yes counts once it is in, so a round's count can
be completed with the record of a process that is gone. Within one group that is a rank
killed after its yes (its peers would enter FlashInfer's exchange with a dead peer); across
groups on a store that outlives its processes (torchrun's static rendezvous restarts its
workers on the agent's store) it is an earlier job's record in a round of the new one,
which a new group whose ranks counted its generation differently can reach (a split).

A record carries its writer's identity: the host's boot (``/proc/sys/kernel/random/
boot_id``), the writer's pid namespace and its start time (``/proc/self/stat``). The rank
that completes a round's count checks, for every record older than ``STALE_S`` whose writer
shares its boot and pid namespace, that the pid still runs and started at that time. Where
it cannot tell (another host, another pid namespace, no ``/proc``), it takes the record as
it is. Healthy rounds pay nothing: their records are milliseconds old.
"""

from __future__ import annotations

import os
from typing import Optional

STALE_S = 1.0  # a record older than this when the count completes has its writer checked

_mine: Optional[tuple] = None


def _read(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode(errors="replace").strip()


def _start_ticks(pid) -> str:
    """A process's start time since boot, in clock ticks (``/proc/<pid>/stat`` field 22);
    "" for a process that has exited and is not reaped yet (a zombie)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rindex(")") + 2:].split(" ")
    return "" if fields[0] in ("Z", "X") else fields[19]


def identity() -> str:
    """``boot/pid-namespace/start`` of this process ("" where it cannot be read). Read once
    per process (a forked child reads its own)."""
    global _mine
    pid = os.getpid()
    if _mine is not None and _mine[0] == pid:
        return _mine[1]
    try:
        text = "/".join((_read("/proc/sys/kernel/random/boot_id"),
                         str(os.stat("/proc/self/ns/pid").st_ino), _start_ticks("self")))
    except (OSError, ValueError, IndexError):
        text = ""
    _mine = (pid, text)
    return text


def _own_proc() -> bool:
    """Whether ``/proc`` shows this process's own pid namespace (a ``/proc`` mounted from
    another one, as in a container given the host's, names every pid differently)."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def gone(pid: int, ident: str) -> bool:
    """Whether the process that wrote a record as ``pid`` with ``identity()`` ``ident`` is
    known to be gone: same boot and pid namespace as this process, and that pid no longer
    runs, or runs a process that started at another time. False where it cannot tell: a
    ``/proc`` of another pid namespace, or one that hides other users' processes
    (``hidepid``: the pid is there, its ``/proc`` entry is not)."""
    mine = identity()
    if not ident or not mine or pid == os.getpid():
        return False
    boot, ns, start = (ident.split("/") + ["", "", ""])[:3]
    my_boot, my_ns, _ = mine.split("/")
    if (boot, ns) != (my_boot, my_ns) or not _own_proc():
        return False
    try:
        return _start_ticks(int(pid)) != start
    except FileNotFoundError:
        return not _runs(int(pid))
    except (OSError, ValueError, IndexError):
        return False


def _runs(pid: int) -> bool:
    """Whether ``pid`` names a process of this pid namespace (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: it runs
        return True
    return True
