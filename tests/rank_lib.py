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


def setup(free_mb=None, *, device=None, **overrides):
    """Install the shim with a simulated device of ``free_mb`` MiB free."""
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace import _probe

    dev = _probe.SimulatedDevice((80 << 30) if free_mb is None else int(free_mb * MiB),
                                 device=0 if device is None else device)
    _probe.set_prober(dev)
    fiws.install(**overrides)
    import flashinfer.comm.allreduce as ar

    ar.TRTLLMAllReduceFusionWorkspace = RecordingWorkspace
    return dev


def need_mb(world_size=2, max_token_num=2048, hidden_dim=4096, dtype="bfloat16", headroom_mb=None):
    """plan peak + headroom in MiB for the installed FlashInfer (trtllm, simulated facts)."""
    import flashinfer
    from flashinfer_safe_workspace import _config, _plan, _probe, rules

    req = _plan.Request("unified", "trtllm", world_size, 0, max_token_num, hidden_dim, dtype)
    facts = _probe.SimulatedDevice(1 << 40).facts(None, False, world_size)
    plan = rules.plan_for(req, facts, flashinfer.__version__)
    head = _config.current().headroom_mb if headroom_mb is None else headroom_mb
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
