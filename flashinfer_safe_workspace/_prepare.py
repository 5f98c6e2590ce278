"""A head start for the first decision: what it would do once per process, done when the
shim hooks FlashInfer (``install()``, or FlashInfer's import under the activation): the
imports, the store lines and the group's generation (one ``add``).

The planning modules are imported (pure Python: some 5 ms that the first decision no
longer pays), FlashInfer's signatures read (how a call's arguments bind) and its release,
and, where a default process group exists already, our store lines are opened: the first
line and the world rank set's waiting line, their threads started and their connections
made, the group's generation read, and the world rank set's worker started, off the
decision's path. No CUDA work, nothing that blocks: the connections are made on the lines'
own threads. Never raises.
"""

from __future__ import annotations

import sys

from . import _bounded, _config
from .agreement import positions as _positions, process as _process, store as _store, vote as _vote


def prepare(originals=()) -> None:
    try:
        from .planning import facts, headroom, request, rules  # noqa: F401 - for the first decision

        request.flashinfer_version()
        _process.identity()  # this process's boot, pid namespace and start (/proc, once)
        for original in originals:  # how a call binds: inspect.signature, read once
            request._keywords(original)
    except Exception:  # noqa: BLE001 - the decision does it itself and reports
        pass
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_initialized():  # no group yet: the first decision opens
            return
        world = _vote.members_key(tuple(range(dist.get_world_size())))
        timeout = _config.current().vote_timeout
        _store.prepare(timeout, world)
        _store.check_world()  # the group's own generation, read on the line's thread
        _positions.current().start_generation(_store.line(timeout), dist.get_world_size())
        _bounded.worker("store:" + world).start()  # its thread, before the first call
    except Exception:  # noqa: BLE001 - only a head start
        pass
