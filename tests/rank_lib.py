"""Helpers imported inside rank processes started by harness.run_ranks."""

from __future__ import annotations

import time

MiB = 1 << 20

calls: list = []


class RecordingWorkspace:
    """Stands in for FlashInfer's TRTLLMAllReduceFusionWorkspace *constructor* only:
    FlashInfer's real create_allreduce_fusion_workspace runs, and when it reaches the
    allocation layer (which needs CUDA) this records the call instead."""

    backend = "trtllm"

    def __init__(self, **kwargs):
        calls.append(kwargs)
        self.kwargs = kwargs

    def destroy(self):
        pass


class _Capture:
    """Keeps this process's log records of the shim (decision lines, warnings)."""

    def __init__(self):
        import logging

        self.records = []
        self.handler = logging.Handler(level=logging.DEBUG)
        self.handler.emit = self.records.append
        log = logging.getLogger("flashinfer_safe_workspace")
        log.addHandler(self.handler)
        log.setLevel(logging.DEBUG)

    def lines(self):
        return [r.getMessage() for r in self.records]


capture = None


def decisions():
    """This process's decision lines so far, parsed (``_log.parse_decision_lines``)."""
    from flashinfer_safe_workspace import _log

    return _log.parse_decision_lines("\n".join(capture.lines() if capture else []))


def last_decision():
    found = decisions()
    return found[-1] if found else None


def warnings():
    return [r.getMessage() for r in (capture.records if capture else []) if r.levelname == "WARNING"]


def host_all_reduce_ok(group=None, timeout=10.0):
    """The host's own collective on its own group still works after our decision."""
    import datetime

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    try:
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # reported, not raised
        return f"{type(exc).__name__}: {exc}"[:300]
    size = dist.get_world_size(group)
    return bool(t.item() == size) or f"all_reduce gave {t.item()} for {size} ranks"


def setup(free_mb=None, *, device=None, sim=None, **overrides):
    """Install the shim with a simulated device of ``free_mb`` MiB free; ``sim``: the
    simulated device's keyword facts for this rank (multicast, fabric, host, ...)."""
    global capture
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace.planning import probe as _probe

    if capture is None:
        capture = _Capture()

    dev = _probe.SimulatedDevice((80 << 30) if free_mb is None else int(free_mb * MiB),
                                 device=0 if device is None else device, **(sim or {}))
    _probe.set_prober(dev)
    fiws.install(**overrides)
    import flashinfer.comm.allreduce as ar

    ar.TRTLLMAllReduceFusionWorkspace = RecordingWorkspace
    ar.MNNVLAllReduceFusionWorkspace = RecordingWorkspace
    return dev


def need_mb(world_size=2, max_token_num=2048, hidden_dim=4096, dtype="bfloat16", headroom_mb=None):
    """plan peak + headroom in MiB for the installed FlashInfer (trtllm, simulated facts)."""
    import flashinfer
    from flashinfer_safe_workspace import _config
    from flashinfer_safe_workspace.planning import plan as _plan, probe as _probe

    req = _plan.Request("unified", "trtllm", world_size, 0, max_token_num, hidden_dim, dtype)
    facts = _probe.SimulatedDevice(1 << 40).facts(None, False, world_size)
    from flashinfer_safe_workspace.planning import rules

    plan = rules.plan_for(req, facts, flashinfer.__version__)
    if headroom_mb is None:  # what the shim itself would use for this call on WORLD
        from flashinfer_safe_workspace.planning import request as _request

        head = _request.headroom(_config.current(), req, {})[0] / MiB
    else:
        head = headroom_mb
    return plan.peak_bytes / MiB + head


def create(**kwargs):
    """Call the (wrapped) unified API; return (outcome, seconds, error text)."""
    import torch
    import flashinfer.comm as comm

    from flashinfer_safe_workspace import WorkspaceVetoed

    args = dict(backend="trtllm", world_size=2, rank=0, max_token_num=2048, hidden_dim=4096,
                dtype=torch.bfloat16)
    args.update(kwargs)
    start = time.perf_counter()
    try:
        ws = comm.create_allreduce_fusion_workspace(**args)
        outcome = "none" if ws is None else "created"
        err = ""
    except WorkspaceVetoed as exc:
        outcome, err = "vetoed", str(exc)
    except Exception as exc:
        outcome, err = "error", f"{type(exc).__name__}: {exc}"
    return outcome, time.perf_counter() - start, err
