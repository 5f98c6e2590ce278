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


if __name__ == "__main__":
    run_main({"h": case_h})
