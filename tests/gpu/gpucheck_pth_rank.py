"""Case h: one rank of an engine-like script that knows nothing of the shim.

Only ``FLASHINFER_SAFE_WORKSPACE=1`` is set in its environment. This script never
imports flashinfer_safe_workspace: the installed wheel's ``.pth`` line must activate
the shim at interpreter start, and FlashInfer's functions must come wrapped. It then
creates a workspace (room on both ranks) and, with rank 0 starved, creates again:
that call must return None on every rank (the default ON_VETO=none).
"""

from __future__ import annotations

import os
import sys
import time

# Before anything else: what did interpreter start-up (site, .pth) do?
AT_START = {
    "fiws_imported_at_start": "flashinfer_safe_workspace" in sys.modules,
    "flashinfer_imported_at_start": "flashinfer" in sys.modules,
    "env": {k: v for k, v in os.environ.items() if k.startswith("FLASHINFER_SAFE_WORKSPACE")},
}

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpucheck_common import (  # noqa: E402  (never imports flashinfer_safe_workspace)
    Call,
    Group,
    MiB,
    collect,
    decision_log,
    emit,
    finish,
    make_device,
    release_workspace,
    run_main,
    settle,
    unified_kwargs,
)


def _pth_files() -> list:
    """Where the package's .pth files are, from the installed distribution's record."""
    try:
        from importlib import metadata

        dist = metadata.distribution("flashinfer-safe-workspace")
        out = []
        for f in dist.files or ():
            if str(f).endswith(".pth"):
                path = str(dist.locate_file(f))
                with open(path) as fh:
                    out.append({"path": path, "text": fh.read().strip()[:300]})
        return out
    except Exception as exc:  # noqa: BLE001
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def _is_ours(fn) -> bool:
    return bool(getattr(fn, "_self_flashinfer_safe_workspace", False))


def case_h(args):
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer.comm as comm
    from flashinfer.comm import allreduce, trtllm_ar

    settle()
    fn = comm.create_allreduce_fusion_workspace
    module = sys.modules.get("flashinfer_safe_workspace")
    emit("activation", **AT_START,
         fiws_file=getattr(module, "__file__", None),
         fiws_version=getattr(module, "__version__", None),
         wrapper_type=f"{type(fn).__module__}.{type(fn).__qualname__}",
         has_wrapped=hasattr(fn, "__wrapped__"),
         unified_wrapped={"flashinfer.comm": _is_ours(comm.create_allreduce_fusion_workspace),
                          "flashinfer.comm.allreduce": _is_ours(allreduce.create_allreduce_fusion_workspace)},
         legacy_wrapped={
             "flashinfer.comm": _is_ours(comm.trtllm_create_ipc_workspace_for_all_reduce_fusion),
             "flashinfer.comm.allreduce": _is_ours(allreduce.trtllm_create_ipc_workspace_for_all_reduce_fusion),
             "flashinfer.comm.trtllm_ar": _is_ours(trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)},
         pth_files=_pth_files(), sys_path_head=sys.path[:4])
    kw = unified_kwargs(p["shape"], rank, world)
    group.barrier()
    ws = None
    with Call("create (room)", phase="room") as c:
        ws = comm.create_allreduce_fusion_workspace(**kw)
    emit("result", phase="room", result="None" if ws is None else type(ws).__name__,
         backend=getattr(ws, "backend", None), seconds=c.seconds, error=c.error)
    if ws is not None:
        dev.sync()
        group.barrier()
        release_workspace(ws)
        ws = None
    starve = p["starve_rank"]
    left = dev.hog().set(p["leave_mb"] * MiB) if rank == starve else None
    group.barrier()
    emit("memory", phase="starved", free=dev.free(), hog_left=left)
    with Call("create (starved)", phase="starved") as c:
        ws = comm.create_allreduce_fusion_workspace(**kw)
    emit("result", phase="starved", result="None" if ws is None else type(ws).__name__,
         seconds=c.seconds, error=c.error)
    if rank == starve:
        dev.hog().release()
    finish(group)


# --------------------------------------------------------------------------- p: the protocol


def _activation(comm) -> dict:
    fn = comm.create_allreduce_fusion_workspace
    module = sys.modules.get("flashinfer_safe_workspace")
    return dict(AT_START, fiws_file=getattr(module, "__file__", None),
                fiws_version=getattr(module, "__version__", None),
                unified_wrapped=_is_ours(fn), pth_files=_pth_files())


def _callers() -> dict:
    """How each step calls FlashInfer: from this script (``__main__``, no engine) or from
    a real module file named like an engine's (``sglang.fiws_probe_caller``,
    ``vllm.fiws_probe_caller``) found on PYTHONPATH, so that the calling frame's module
    is that name."""
    import importlib

    out = {"plain": lambda fn, kw: fn(**kw)}
    for engine in ("sglang", "vllm"):
        try:
            mod = importlib.import_module(f"{engine}.fiws_probe_caller")
            out[engine] = mod.create
        except ImportError as exc:
            emit("warning", where=f"caller stub {engine}", error={"type": "ImportError",
                                                                  "msg": str(exc)})
    return out


def _outcome(result, error) -> str:
    if error is not None:
        return "raised " + str(error.get("type", "?")).rsplit(".", 1)[-1]
    return "None" if result is None else "created"


def _snap(dev, group, where: str) -> dict:
    dev.sync()
    collect()
    group.barrier()
    free, total = dev.free_total()
    rec = {"where": where, "free": free, **dev.torch_stats(), "own": dev.own()}
    emit("snap", **rec)
    return rec


def case_p(args):
    """Pass and veto through the .pth-activated shim: each step calls FlashInfer from a
    plain or an engine-named caller, with or without rank ``starve_rank`` starved, and
    reports the answer, the times, the decision line and the free memory around it."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    dev.track_own()  # before the shim's first probe: what this rank holds, not the device
    group = Group(args, dev)
    import flashinfer.comm as comm

    log = decision_log()
    emit("activation", **_activation(comm))
    callers = _callers()
    settle()
    # every rank's CUDA context exists before any rank starves the (maybe shared) GPU
    _snap(dev, group, "start")
    starve = p.get("starve_rank", 0)
    for i, step in enumerate(p["steps"]):
        kw = unified_kwargs(step["shape"], rank, world)
        left = None
        if step.get("starve") and rank == starve:
            left = dev.hog().set(int(p.get("leave_mb", 16)) * MiB)
        before = _snap(dev, group, f"step{i}_before")
        mark = log.mark()
        fn = callers.get(step.get("caller", "plain"))
        group.barrier()
        result = None
        with Call(f"step{i}", step=i) as c:
            if fn is None:
                raise RuntimeError(f"no caller {step.get('caller')}")
            result = fn(comm.create_allreduce_fusion_workspace, kw)
        wall_end = time.time()
        after = _snap(dev, group, f"step{i}_after")
        got = log.since(mark)
        emit("step", i=i, label=step.get("label"), caller=step.get("caller", "plain"),
             starve=bool(step.get("starve")), starved=bool(step.get("starve")) and rank == starve,
             outcome=_outcome(result, c.error), error=c.error, seconds=c.seconds,
             wall_start=c.wall_start, wall_end=wall_end, free_before=before["free"],
             free_after=after["free"], reserved_before=before["reserved"],
             reserved_after=after["reserved"], own_before=before["own"],
             own_after=after["own"], hog_left=left,
             decisions=got["decisions"], warnings=got["warnings"][:4])
        if result is not None:
            dev.sync()
            group.barrier()
            release_workspace(result)
            result = None
        if left is not None:
            dev.hog().release()
        group.barrier()
    finish(group)


# --------------------------------------------------------------------------- q: audit and tails


def case_q(args):
    """Real creations through the .pth-activated shim: the decision line's audit field
    for each, and the free memory around each (the first creation of the process, then
    later ones), next to the plan on the decision line."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer.comm as comm

    log = decision_log()
    emit("activation", **_activation(comm))
    settle()
    _snap(dev, group, "start")
    for i, item in enumerate(p["creations"]):
        kw = unified_kwargs(item["shape"], rank, world)
        before = _snap(dev, group, f"c{i}_before")
        mark = log.mark()
        ws = None
        with Call(f"create#{i}", i=i) as c:
            ws = comm.create_allreduce_fusion_workspace(**kw)
        after = _snap(dev, group, f"c{i}_after")
        got = log.since(mark)
        released, outcome = None, _outcome(ws, c.error)
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws)
            ws = None
            released = _snap(dev, group, f"c{i}_released")
        emit("creation", i=i, name=item["name"], shape=item["shape"], first=i == 0,
             outcome=outcome,
             error=c.error, seconds=c.seconds, free_before=before["free"],
             free_after=after["free"], free_released=(released or {}).get("free"),
             reserved_before=before["reserved"], reserved_after=after["reserved"],
             decisions=got["decisions"], warnings=got["warnings"][:4])
    finish(group)


if __name__ == "__main__":
    run_main({"h": case_h, "p": case_p, "q": case_q})
