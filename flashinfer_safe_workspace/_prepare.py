"""A head start for the first decision: what it would do once per process, done when the
shim hooks FlashInfer (``install()``, or FlashInfer's import under the activation).

The planning modules are imported (pure Python: some 5 ms that the first decision no
longer pays), and, where a default process group exists already, our store lines are
opened: the first line and the world rank set's waiting line, their threads started and
their connections made, off the decision's path. No CUDA work, nothing that blocks: the
connections are made on the lines' own threads. Never raises.
"""

from __future__ import annotations

import sys

from . import _config
from .agreement import store as _store, vote as _vote


def prepare() -> None:
    try:
        from .planning import facts, headroom, rules  # noqa: F401 - imported for the first decision
    except Exception:  # noqa: BLE001 - the decision imports them itself and reports
        pass
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_initialized():  # no group yet: the first decision opens
            return
        world = _vote.members_key(tuple(range(dist.get_world_size())))
        _store.prepare(_config.current().vote_timeout, world)
    except Exception:  # noqa: BLE001 - only a head start
        pass
