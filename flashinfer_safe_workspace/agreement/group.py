"""Which ranks decide together, and how their records travel.

Read-only on the host's state: group membership is asked with
``get_process_group_ranks``; no group is created, no collective runs on any group (the
records go through the c10d store, see ``_vote``).

* A ``comm_backend`` that carries a torch group (SGLang's ``_cpu_group``, FlashInfer's
  ``TorchDistBackend._group``): that group's ranks, through the store.
* ``group=`` (or, without it, WORLD): its ranks, through the store.
* A ``comm_backend`` with no torch group (MPI, custom): its own ``allgather``.
* torch.distributed not initialised and no comm backend, or a group of one: local.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

NO_PROCESS_GROUP = "torch.distributed not initialised"


@dataclasses.dataclass(frozen=True)
class Members:
    kind: str  # "store" | "allgather" | "local"
    ranks: tuple  # global ranks in group order (allgather: positions 0..n-1)
    me: int  # this rank's position in ``ranks``
    label: str
    comm: Any = None  # the comm backend, for "allgather"

    @property
    def size(self) -> int:
        return len(self.ranks)


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        try:
            import torch.distributed as dist  # noqa: F811
        except Exception:  # noqa: BLE001
            return None
    return dist


def initialised() -> bool:
    dist = _dist()
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def global_rank() -> int:
    dist = _dist()
    try:
        if initialised():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001
        pass
    return -1


def world_size() -> int:
    """The default group's size (1 without one)."""
    dist = _dist()
    try:
        if initialised():
            return max(int(dist.get_world_size()), 1)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _torch_group_of(comm_backend) -> tuple:
    """(found, group) for a comm backend that exchanges over a torch group."""
    for name in ("_cpu_group", "_group", "group"):
        if name in getattr(comm_backend, "__dict__", {}) or hasattr(type(comm_backend), name):
            try:
                return True, getattr(comm_backend, name)
            except Exception:  # noqa: BLE001
                continue
    return False, None


class ForkedChild(RuntimeError):
    """This process was forked from a rank after torch.distributed started: it is no rank."""


_default_at_fork = None  # the default group object when this process was forked from a rank


def _before_fork():
    global _pending
    _pending = None
    try:
        if initialised():
            _pending = _dist().distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001
        _pending = None


def _after_fork_in_child():
    global _default_at_fork
    _default_at_fork = _pending


_pending = None
if hasattr(__import__("os"), "register_at_fork"):
    __import__("os").register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _check_not_forked():
    if _default_at_fork is None:
        return
    try:
        same = _dist().distributed_c10d._get_default_group() is _default_at_fork
    except Exception:  # noqa: BLE001
        same = True
    if same:
        raise ForkedChild("this process was forked from a rank after torch.distributed was "
                          "initialised; it is no rank of the group and cannot take part")


def _from_group(group, label: str) -> Members:
    _check_not_forked()
    dist = _dist()
    target = group if group is not None else dist.group.WORLD
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(target))
    me_global = int(dist.get_rank())
    if me_global not in ranks:
        raise ValueError(f"this process (rank {me_global}) is not a member of {label} {list(ranks)}")
    kind = "store" if len(ranks) > 1 else "local"
    return Members(kind, ranks, ranks.index(me_global), label)


def members_for(*, group, comm_backend, uses_comm_backend: bool) -> Members:
    """The ranks that will create this workspace together, and the transport to use."""
    if comm_backend is not None and uses_comm_backend:
        found, inner = _torch_group_of(comm_backend)
        if found and initialised():
            name = "comm_backend._cpu_group" if getattr(comm_backend, "_cpu_group", None) is inner \
                else "comm_backend group"
            return _from_group(inner, name if inner is not None else "WORLD")
        size, index = int(comm_backend.Get_size()), int(comm_backend.Get_rank())
        kind = "allgather" if size > 1 else "local"
        return Members(kind, tuple(range(size)), index, type(comm_backend).__name__, comm_backend)
    if not initialised():
        return Members("local", (0,), 0, NO_PROCESS_GROUP)
    return _from_group(group, "group" if group is not None else "WORLD")


def guess_members(kwargs: dict) -> Optional[Members]:
    """Best effort for a call whose arguments do not bind: the group it names, or WORLD."""
    try:
        return members_for(group=kwargs.get("group"), comm_backend=kwargs.get("comm_backend"),
                           uses_comm_backend=True)
    except Exception:  # noqa: BLE001
        return None
