"""Helpers imported inside rank processes started by harness.run_ranks."""

from __future__ import annotations

import logging
import sys
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
        self.handler.emit = self._keep
        log = logging.getLogger("flashinfer_safe_workspace")
        log.addHandler(self.handler)
        log.setLevel(logging.DEBUG)

    def _keep(self, record):
        self.records.append(record)
        if record.levelno >= logging.WARNING:  # what Python's last-resort handler would print
            sys.stderr.write(record.getMessage() + "\n")

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


_installed: dict = {}  # the settings ``setup`` installed the shim with


def relax(vote_timeout: float = 30.0) -> None:
    """From now on, a vote timeout no rank is meant to wait out (the scenarios' ``LONG_T``):
    the calls after a phase that waited a short timeout out must be created, also on a
    loaded machine. Keeps every other setting and the cached vetoes (no ``install()``)."""
    from flashinfer_safe_workspace import _config

    _config.reload(enabled=True, **{**_installed, "vote_timeout": vote_timeout})


def setup(free_mb=None, *, device=None, sim=None, **overrides):
    """Install the shim with a simulated device of ``free_mb`` MiB free; ``sim``: the
    simulated device's keyword facts for this rank (multicast, fabric, host, ...)."""
    global capture
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    if capture is None:
        capture = _Capture()

    dev = SimulatedDevice((80 << 30) if free_mb is None else int(free_mb * MiB),
                                 device=0 if device is None else device, **(sim or {}))
    _probe.set_prober(dev)
    fiws.install(**overrides)
    _installed.clear()
    _installed.update(overrides)
    import flashinfer.comm.allreduce as ar

    ar.TRTLLMAllReduceFusionWorkspace = RecordingWorkspace
    ar.MNNVLAllReduceFusionWorkspace = RecordingWorkspace
    return dev


# What FlashInfer 0.7.4's trtllm workspace holds per rank (max_token_num 2048, hidden_dim 4096,
# bfloat16), written down, not computed by the rules: for 2 ranks the cuMemCreate sizes
# recorded on the H200 (reference notes section 9: 35651584, 2097152, 102760448 B); for 4
# ranks the same formula by hand (section 2.1: B = ws*T*H*2 = 64 MiB, L = 3*B = 192 MiB, each
# + 2048 B rounded to 2 MiB: 66, 2, 194 MiB); plus the small tails of section 5: one int64[ws]
# pointer table per buffer, cudaMalloc(20) and an int64[3*ws + 1] table.
PLAN_BYTES = {
    2: 35651584 + 2097152 + 102760448 + 3 * 8 * 2 + 20 + (3 * 2 + 1) * 8,  # 140509308
    4: 69206016 + 2097152 + 203423744 + 3 * 8 * 4 + 20 + (3 * 4 + 1) * 8,  # 274727132
    # the scale cases, worked by hand the same way (reference §2.1: B = ws*T*H*2 and
    # L = 3*B, each + 2048 B rounded to 2 MiB; F = 1024*ws in one granule; below the
    # lamport clamp of 2145386496 B, so no more than 72 ranks at this shape)
    8: 136314880 + 2097152 + 404750336 + 3 * 8 * 8 + 20 + (3 * 8 + 1) * 8,  # 543162780
    16: 270532608 + 2097152 + 807403520 + 3 * 8 * 16 + 20 + (3 * 16 + 1) * 8,  # 1080034076
    32: 538968064 + 2097152 + 1612709888 + 3 * 8 * 32 + 20 + (3 * 32 + 1) * 8,  # 2153776668
    64: 1075838976 + 2097152 + 3223322624 + 3 * 8 * 64 + 20 + (3 * 64 + 1) * 8,  # 4301261852
    72: 1210056704 + 2097152 + 3625975808 + 3 * 8 * 72 + 20 + (3 * 72 + 1) * 8,  # 4838133148
}
# HEADROOM_MB=auto over a gloo group: the small reserve (docs/settings.md, "HEADROOM_MB")
SMALL_RESERVE_MB = 64


def need_mb(world_size=2, max_token_num=2048, hidden_dim=4096, dtype="bfloat16", headroom_mb=None):
    """Plan peak + headroom in MiB of the trtllm workspace for FlashInfer 0.7.4 (the numbers
    above; only those shapes are written down)."""
    assert (max_token_num, hidden_dim, dtype) == (2048, 4096, "bfloat16"), "shape not written down"
    head = SMALL_RESERVE_MB if headroom_mb is None else headroom_mb
    return PLAN_BYTES[world_size] / MiB + head


last_reasons = None  # the reason-code names of the last create()'s veto (None: not known)


def create(**kwargs):
    """Call the (wrapped) unified API; return (outcome, seconds, error text). The veto's
    reason codes (by name) go to ``last_reasons``: from ``WorkspaceVetoed.reasons`` when it
    raises, else from this call's decision line (``None`` when it logged none)."""
    global last_reasons
    import torch
    import flashinfer.comm as comm

    from flashinfer_safe_workspace import WorkspaceVetoed, _reasons

    args = dict(backend="trtllm", world_size=2, rank=0, max_token_num=2048, hidden_dim=4096,
                dtype=torch.bfloat16)
    args.update(kwargs)
    before = len(decisions())
    last_reasons = None
    start = time.perf_counter()
    try:
        ws = comm.create_allreduce_fusion_workspace(**args)
        outcome = "none" if ws is None else "created"
        err = ""
    except WorkspaceVetoed as exc:
        outcome, err = "vetoed", str(exc)
        last_reasons = list(_reasons.names(exc.reasons))
    except Exception as exc:
        outcome, err = "error", f"{type(exc).__name__}: {exc}"
    secs = time.perf_counter() - start
    if last_reasons is None:
        new = decisions()[before:]
        last_reasons = new[-1]["reasons"] if new else None
    return outcome, secs, err


# -- fault points (flashinfer_safe_workspace._points): a scenario acts at a named place in
# the decision instead of sleeping in the hope of landing inside a window
_actions: dict = {}


def at(point: str, action) -> None:
    """Run ``action()`` whenever this process reaches the fault point ``point`` (in the
    thread that reaches it; what it raises propagates from there). ``None`` removes it."""
    from flashinfer_safe_workspace import _points

    if action is None:
        _actions.pop(point, None)
    else:
        _actions[point] = action
    _points.install(_dispatch if _actions else None)


def _dispatch(name: str) -> None:
    action = _actions.get(name)
    if action is not None:
        action()


def once(action):
    """``action`` on the first call only (a point reached again later does nothing)."""
    done = []

    def first():
        if not done:
            done.append(1)
            action()
    return first


def late_probe(dev, before=None):
    """Make this rank's probe late, whatever the scheduler does: at the ``probe`` fault point
    (on the worker that runs the decision's steps, before the record) run ``before()``, stop
    this process (SIGSTOP; a peer resumes it), and once resumed hold the probe until the
    returned ``answered`` event is set. The call's own thread therefore always reaches its
    deadline with the probe still running (the bounded runner's STEP_TIMEOUT), instead of
    racing the resumed probe. Set ``answered`` once the call has returned; the probe then
    ends in the background and sets the returned ``probed``: wait on it (bounded) before
    reading the bytes held. ``(answered, probed)``."""
    import threading

    answered, probed, probe = threading.Event(), threading.Event(), dev.probe

    def hold():
        if before is not None:
            before()
        stop_self()
        answered.wait(60)

    def probe_then_tell(*args, **kwargs):
        try:
            return probe(*args, **kwargs)
        finally:
            probed.set()

    at("probe", hold)
    dev.probe = probe_then_tell
    return answered, probed


def stop_self() -> None:
    """SIGSTOP this whole process (a peer or a helper resumes it with SIGCONT)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGSTOP)


def wait_stopped(pid: int, timeout: float = 60.0) -> bool:
    """Until process ``pid`` is stopped (state T in /proc); False after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state in ("T", "t"):
            return True
        time.sleep(0.01)
    return False
