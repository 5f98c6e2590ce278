"""One rank of a GPU-check case (a–g). Started twice by ``gpucheck_cases`` (rank r on cuda:r).

    python3 tests/gpu/gpucheck_rank.py --case a --rank 0 --world-size 2 --port P --params JSON

Case h (activation through the ``.pth``) has its own script, ``gpucheck_pth_rank.py``,
because that rank script must not import flashinfer_safe_workspace itself.
Results go to stdout as ``@@GPUCHECK {json}`` lines (see gpucheck_common).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpucheck_common import (  # noqa: E402
    Call,
    Group,
    MiB,
    collect,
    decision_log,
    emit,
    exc_info,
    finish,
    legacy_kwargs,
    make_device,
    release_workspace,
    run_main,
    settle,
    unified_kwargs,
    unwrap,
)


# --------------------------------------------------------------------------- helpers


_overrides: dict = {}


def shim_install(**overrides):
    """Activate the shim explicitly (install()), with fakes wired in on CPU."""
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace import _config

    _overrides.clear()
    _overrides.update(overrides)
    if os.environ.get("GPUCHECK_FAKE") == "1":
        # the fakes model NCCL's cold start-up on a gloo group, which HEADROOM_MB=auto
        # (rightly) reads as gloo: pin the NCCL reserve that auto gives a cold NCCL group
        from flashinfer_safe_workspace.planning import headroom as _headroom

        _overrides.setdefault("headroom_mb", _headroom.NCCL_RESERVE_MB)
    fiws.install(**_overrides)
    if os.environ.get("GPUCHECK_FAKE") == "1":
        import gpucheck_fake

        gpucheck_fake.install_prober()
    import dataclasses

    import flashinfer.comm  # noqa: F401  (wrapped on import)

    decision_log()  # after install(): debug=True attaches its stderr handler first
    emit("shim", installed=fiws.is_installed(), version=fiws.__version__,
         file=fiws.__file__, settings=dataclasses.asdict(_config.current()))
    settle()
    return fiws


def set_on_veto(fiws, **overrides):
    _overrides.update(overrides)
    fiws.install(**_overrides)
    if os.environ.get("GPUCHECK_FAKE") == "1":
        import gpucheck_fake

        gpucheck_fake.install_prober()


class shim_off:
    """FlashInfer without the shim, in a process where it is installed.

    Every ``flashinfer.*`` binding that holds one of the shim's proxies gets FlashInfer's
    function back for the duration, and the proxy again afterwards. Calling the unified
    proxy's ``__wrapped__`` alone is not enough: FlashInfer's unified function calls the
    legacy function through its (wrapped) binding in ``flashinfer.comm.allreduce``, which
    would probe and vote. ``uninstall()`` is not used either: it misses bindings that
    took the proxy by ``from ... import`` after the import hook wrapped the defining module
    (tests/activation/test_compat.py's xfail), which is exactly ``allreduce``'s binding here."""

    NAMES = ("create_allreduce_fusion_workspace",
             "trtllm_create_ipc_workspace_for_all_reduce_fusion")

    def __enter__(self):
        self.swapped = []
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "flashinfer" or name.startswith("flashinfer.")):
                continue
            for attr in self.NAMES:
                proxy = getattr(module, "__dict__", {}).get(attr)
                if getattr(proxy, "_self_flashinfer_safe_workspace", False):
                    original = unwrap(proxy)
                    setattr(module, attr, original)
                    self.swapped.append((module, attr, proxy, original))
        return self

    def __exit__(self, *exc):
        for module, attr, proxy, original in reversed(self.swapped):
            if module.__dict__.get(attr) is original:
                setattr(module, attr, proxy)
        self.swapped = []
        return False


def legacy_function():
    import flashinfer.comm as comm

    return unwrap(comm.trtllm_create_ipc_workspace_for_all_reduce_fusion)


def plan_for(entry: str, fn, kwargs: dict):
    """The shim's own plan for this call, built as its decision builds it.

    Tries the runtime-facts API (``_facts.runtime_facts`` + ``rules.plan_for``) first and
    falls back to the older one (``prober.facts`` + ``_plan.make_plan``), so the harness
    runs on the code before and after that change."""
    import flashinfer
    from flashinfer_safe_workspace import _decide
    from flashinfer_safe_workspace.planning import probe as _probe

    if os.environ.get("GPUCHECK_FAKE") == "1":
        import gpucheck_fake

        gpucheck_fake.install_prober()
    from flashinfer_safe_workspace.planning import request as _request

    req, _ = _request.build(entry, unwrap(fn), (), kwargs)
    cc = _request._confidential_compute() if entry == _request.UNIFIED else False
    prober = _probe.get_prober()
    try:
        from flashinfer_safe_workspace.planning import facts as _facts

        facts = _facts.runtime_facts(prober, confidential_compute=cc, world_size=req.world_size)
    except ImportError:
        facts = _request.facts_for(req, None)
    try:
        from flashinfer_safe_workspace.planning import rules

        return rules.plan_for(req, facts, flashinfer.__version__)
    except ImportError:
        from flashinfer_safe_workspace.planning import plan as _plan

        return _plan.make_plan(req, facts, flashinfer.__version__)


def describe(result) -> str:
    if result is None:
        return "None"
    if isinstance(result, tuple):
        return f"tuple[{len(result)}]"
    return type(result).__name__


_report_mark = [0]


def last_report():
    """What the shim decided in the latest call since ``clear_report()``: the fields of
    its decision line (``vote`` is yes for outcome=pass), over the older in-process
    ``_decide.last_report`` where that still exists (it has probe_ms and vote_ms)."""
    from flashinfer_safe_workspace import _decide

    out = dict(getattr(_decide, "last_report", None) or {})
    line = decision_log().last_decision(_report_mark[0])
    if line is not None:
        outcome = str(line.get("outcome", ""))
        if outcome == "veto-cached":  # answered from the veto cache: no vote
            out["cached"] = True
        elif not out.get("vote"):
            out["vote"] = "yes" if outcome == "pass" else ("no" if outcome == "veto" else None)
        for key in ("plan_bytes", "free_bytes", "headroom_bytes", "elapsed_ms"):
            if key in line and key not in out:
                out[key] = line[key]
        out["line"] = line
    return out


def clear_report():
    from flashinfer_safe_workspace import _decide

    legacy = getattr(_decide, "last_report", None)
    if isinstance(legacy, dict):
        legacy.clear()
    _report_mark[0] = decision_log().mark()


def clear_veto_cache():
    """Forget cached vetoes (``_decide.clear_cache``; ``uninstall()`` + ``install()`` where
    that is gone), so the next call decides afresh."""
    from flashinfer_safe_workspace import _decide

    fn = getattr(_decide, "clear_cache", None)
    if fn is not None:
        fn()
    elif _overrides is not None:
        set_on_veto(__import__("flashinfer_safe_workspace"))


def snapshot(dev, group, where: str, **extra) -> dict:
    dev.sync()
    collect()
    group.barrier()
    free, total = dev.free_total()
    record = {"where": where, "free": free, "total": total, **dev.torch_stats(), **extra}
    emit("snap", **record)
    return record


# --------------------------------------------------------------------------- a: positive


def _inputs(seed: int, n: int, h: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g, dtype=torch.float32).to(torch.bfloat16)


# bf16: 8 significant bits, so one rounding is at most 2**-8 relative and one ulp 2**-7.
# The kernels may round intermediate sums (the all-reduce sum before the residual add),
# so errors are bounded relative to the magnitude of the operands ("scale"), not of the
# result: |out - ref| <= ATOL + RTOL * scale elementwise, and ||out - ref|| / ||ref||
# <= REL_TOL overall (METHOD.md: bf16 operands land between 1e-3 and 1e-2).
ATOL, RTOL, REL_TOL = 1e-3, 1.6e-2, 1e-2


def _metrics(out, ref, scale) -> dict:
    import torch

    got = out.detach().to("cpu", torch.float64)
    nan = int(torch.isnan(got).sum())
    diff = (got - ref).abs()
    rel = float(diff.norm() / ref.norm()) if float(ref.norm()) > 0 else float(diff.norm())
    bound = ATOL + RTOL * scale
    bad = int((diff > bound).sum()) + nan
    ratio = float((diff / bound).nan_to_num(nan=float("inf")).max())
    return {"rel_l2": rel, "max_abs": float(diff.nan_to_num(nan=float("inf")).max()),
            "max_err_over_bound": ratio, "nan": nan, "n_outside": bad, "atol": ATOL,
            "rtol": RTOL, "rel_tol": REL_TOL, "ok": nan == 0 and bad == 0 and rel <= REL_TOL}


def accuracy(comm, ws, dev, rank: int, world: int, hidden: int, tokens: list) -> list:
    """kAllReduce and kARResidualRMSNorm against float64 references on the CPU.

    Inputs are bf16, random, different per rank and per token count (every rank can
    rebuild every rank's input from its seed); outputs are poisoned with NaN first."""
    import torch

    pat = comm.AllReduceFusionPattern
    eps = 1e-6
    rows = []
    for n in tokens:
        xs = [_inputs(1000 * n + r, n, hidden) for r in range(world)]
        x = xs[rank].to(dev.torch_device)
        total = sum(t.to(torch.float64) for t in xs)
        scale = sum(t.to(torch.float64).abs() for t in xs)
        # kAllReduce
        out = torch.full_like(x, float("nan"))
        with Call(f"allreduce kAllReduce n={n}") as c:
            comm.allreduce_fusion(input=x, workspace=ws, pattern=pat.kAllReduce,
                                  launch_with_pdl=False, output=out)
            dev.sync()
        row = {"pattern": "kAllReduce", "tokens": n, "error": c.error, "seconds": c.seconds}
        if c.error is None:
            row["output"] = _metrics(out, total, scale)
        row["ok"] = c.error is None and row["output"]["ok"]
        rows.append(row)
        # kARResidualRMSNorm (residual and gamma the same on every rank, as in TP)
        res = _inputs(7 + n, n, hidden)
        g = torch.Generator().manual_seed(99)
        gamma = (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
        res_d, gamma_d = res.to(dev.torch_device), gamma.to(dev.torch_device)
        res_out = torch.full_like(x, float("nan"))
        norm_out = torch.full_like(x, float("nan"))
        with Call(f"allreduce kARResidualRMSNorm n={n}") as c:
            comm.allreduce_fusion(input=x, workspace=ws, pattern=pat.kARResidualRMSNorm,
                                  launch_with_pdl=False, residual_in=res_d,
                                  residual_out=res_out, norm_out=norm_out,
                                  rms_gamma=gamma_d, rms_eps=eps)
            dev.sync()
        res64, gamma64 = res.to(torch.float64), gamma.to(torch.float64)
        pre = total + res64
        inv_rms = torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + eps)
        norm = pre * inv_rms * gamma64
        pre_scale = scale + res64.abs()
        norm_scale = gamma64.abs() * pre_scale * inv_rms + norm.abs()
        row = {"pattern": "kARResidualRMSNorm", "tokens": n, "error": c.error,
               "seconds": c.seconds}
        if c.error is None:
            row["residual_out"] = _metrics(res_out, pre, pre_scale)
            row["norm_out"] = _metrics(norm_out, norm, norm_scale)
        row["ok"] = (c.error is None and row["residual_out"]["ok"] and row["norm_out"]["ok"])
        rows.append(row)
    return rows


def case_a(args):
    """Positive: shim on, room on both ranks, cold NCCL -> a real trtllm workspace that
    computes the right all-reduce and residual+RMSNorm."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    fiws = shim_install(on_veto="none", debug=True)
    import flashinfer.comm as comm

    shape = p["shape"]
    snapshot(dev, group, "before_create")
    clear_report()
    ws = None
    with Call("create", shim=True) as c:
        ws = comm.create_allreduce_fusion_workspace(**unified_kwargs(shape, rank, world))
        c.result_note = describe(ws)
    emit("created", result=describe(ws), backend=getattr(ws, "backend", None),
         seconds=c.seconds, error=c.error, report=last_report(),
         metadata={k: v for k, v in (getattr(ws, "metadata", None) or {}).items()
                   if isinstance(v, (int, float, bool, str))} if ws is not None else None)
    snapshot(dev, group, "after_create")
    if ws is not None:
        rows = accuracy(comm, ws, dev, rank, world, shape["H"], p["tokens"])
        emit("accuracy", rows=rows)
        dev.sync()
        group.barrier()
        release_workspace(ws)
        ws = None
        snapshot(dev, group, "after_release")
    del fiws
    finish(group)


# --------------------------------------------------------------------------- b: starved, shim on


def case_b(args):
    """Starved rank with the shim: None on every rank (and WorkspaceVetoed in raise
    mode), cold NCCL then warm NCCL, with time to decision per rank."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    fiws = shim_install(on_veto="none", debug=True)
    import flashinfer.comm as comm
    from flashinfer_safe_workspace import WorkspaceVetoed, _decide

    kw = unified_kwargs(p["shape"], rank, world)
    starve = p["starve_rank"]
    for phase, leave_mb in (("cold", p["leave_cold_mb"]), ("warm", p["leave_warm_mb"])):
        if phase == "warm":
            with Call("warm NCCL"):
                group.warm_nccl()
        left = dev.hog().set(leave_mb * MiB) if rank == starve else None
        snapshot(dev, group, f"{phase}_before", phase=phase, starved=rank == starve,
                 hog_left=left, leave_target=leave_mb * MiB if rank == starve else None)
        for mode in ("none", "raise"):
            set_on_veto(fiws, on_veto=mode, debug=True)
            clear_veto_cache()
            clear_report()
            group.barrier()
            outcome, veto, result = "?", None, None
            with Call(f"{phase}/{mode}", phase=phase, mode=mode) as c:
                try:
                    result = comm.create_allreduce_fusion_workspace(**kw)
                    outcome = "None" if result is None else f"created {describe(result)}"
                except WorkspaceVetoed as exc:
                    outcome = "raised WorkspaceVetoed"
                    veto = {"message": str(exc), "ranks": list(exc.ranks),
                            "details": list(exc.details)}
                    result = None
            if c.error is not None:
                outcome = f"raised {c.error['type']}"
            emit("decision", phase=phase, mode=mode, outcome=outcome, seconds=c.seconds,
                 wall_start=c.wall_start, report=last_report(), veto=veto, error=c.error,
                 nccl_warm=group.nccl_warm)
            if result is not None:
                release_workspace(result)
                result = None
                collect()
        if rank == starve:
            dev.hog().release()
        group.barrier()
    finish(group)


# --------------------------------------------------------------------------- c: starved, no shim


def case_c(args):
    """The 'before' column: FlashInfer 0.7.4 alone, one rank starved. Lingers after
    reporting (a blocked peer keeps waiting on a live process, as in an engine)."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer.comm as comm

    settle()
    fn = comm.create_allreduce_fusion_workspace
    emit("shim_state", imported="flashinfer_safe_workspace" in sys.modules,
         wrapped=bool(getattr(fn, "_self_flashinfer_safe_workspace", False)),
         env={k: v for k, v in os.environ.items() if k.startswith("FLASHINFER_SAFE_WORKSPACE")})
    if p["nccl"] == "warm":
        with Call("warm NCCL"):
            group.warm_nccl()
    starve = p["starve_rank"]
    left = dev.hog().set(p["leave_mb"] * MiB) if rank == starve else None
    snapshot(dev, group, "before_call", starved=rank == starve, hog_left=left,
             nccl=p["nccl"])
    ws = None
    with Call("create", nccl=p["nccl"], unprotected=True) as c:
        ws = fn(**unified_kwargs(p["shape"], rank, world))
        c.result_note = describe(ws)
    emit("outcome", created=ws is not None, seconds=c.seconds, wall_start=c.wall_start,
         error=c.error, nccl=p["nccl"])
    finish(None, linger=True, barrier=False)


# --------------------------------------------------------------------------- d: boundary sweep


def case_d(args):
    """Starve rank 0 to plan peak + headroom + delta (or plan peak + ``above_plan_mb``);
    does the shim decide where the plan says, and does FlashInfer succeed whenever it
    lets the call through? After a veto, FlashInfer is called unprotected at the same
    leftover (false vetoes). ``nccl``: warm (default: module preloaded, NCCL warmed) or
    cold (nothing before); ``group``: world (default) or gloo (FlashInfer's collectives on
    a gloo group); ``headroom_mb`` None: the shim's default headroom."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    headroom_mb = p.get("headroom_mb")
    headroom = int(headroom_mb or 0) * MiB
    if headroom_mb is None:
        fiws = shim_install(on_veto="none", debug=True)
    else:
        fiws = shim_install(on_veto="none", headroom_mb=int(headroom_mb), debug=True)
    import flashinfer.comm as comm

    wrapped = comm.create_allreduce_fusion_workspace
    original = unwrap(wrapped)
    fi_group = None
    if p.get("group") == "gloo":
        import datetime

        fi_group = group.dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    if p.get("nccl", "warm") == "warm":
        with Call("warm-up: module + NCCL"):
            dev.preload_flashinfer_module()
            group.warm_nccl()
    emit("nccl_state", nccl=p.get("nccl", "warm"), warm=group.nccl_warm, group=p.get("group", "world"))

    def kwargs_of(shape):
        kw = unified_kwargs(shape, rank, world)
        if fi_group is not None:
            kw["group"] = fi_group
        return kw

    if p["points"]:  # imports the plan's modules before the gc freeze
        plan_for("unified", wrapped, kwargs_of(p["points"][0]["shape"]))
    settle()
    starve = p["starve_rank"]
    for point in p["points"]:
        idx, shape = point["idx"], point["shape"]
        delta = int(point.get("delta_mb") or 0)
        kw = kwargs_of(shape)
        plan = plan_for("unified", wrapped, kw)
        need = plan.peak_bytes + headroom
        if point.get("above_plan_mb") is not None:
            leave = plan.peak_bytes + int(point["above_plan_mb"]) * MiB
        else:
            leave = need + delta * MiB
        left = dev.hog().set(leave) if rank == starve else None
        snap = snapshot(dev, group, f"point{idx}_before", idx=idx)
        emit("point_start", idx=idx, shape=shape, delta_mb=delta,
             above_plan_mb=point.get("above_plan_mb"), plan_peak=plan.peak_bytes,
             plan_cumemcreate=sum(a.bytes for a in plan.allocations
                                  if a.held and a.api == "cuMemCreate"),
             headroom=headroom if headroom_mb is not None else None,
             need=need if headroom_mb is not None else None,
             leave_target=leave if rank == starve else None,
             hog_left=left, free_before=snap["free"], starved=rank == starve)
        clear_report()
        clear_veto_cache()  # a veto is cached per arguments: every point votes afresh
        group.barrier()
        ws = None
        with Call(f"shim#{idx}", idx=idx, kind="shim") as c:
            ws = wrapped(**kw)
            c.result_note = describe(ws)
        outcome = "flashinfer_error" if c.error else ("created" if ws is not None else "vetoed")
        emit("point_shim", idx=idx, outcome=outcome, error=c.error, seconds=c.seconds,
             report=last_report())
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws)
            ws = None
        collect()
        group.barrier()
        if outcome == "vetoed" and p.get("unprotected_after_veto", True):
            free2 = dev.free()
            group.barrier()
            ws2 = None
            with shim_off():
                with Call(f"unprotected#{idx}", idx=idx, kind="unprotected") as c2:
                    ws2 = original(**kw)
                    c2.result_note = describe(ws2)
            emit("point_unprotected", idx=idx, free_before=free2,
                 outcome="created" if ws2 is not None else "flashinfer_error",
                 error=c2.error, seconds=c2.seconds)
            if ws2 is not None:
                dev.sync()
                group.barrier()
                release_workspace(ws2)
                ws2 = None
            collect()
            group.barrier()
        if rank == starve:
            dev.hog().release()
        snapshot(dev, group, f"point{idx}_after", idx=idx)
        emit("point_done", idx=idx)
    del fiws
    finish(group, linger=bool(p.get("linger")))


# --------------------------------------------------------------------------- k: cold NCCL, no shim


def case_k(args):
    """FlashInfer 0.7.4 alone, NCCL WORLD initialised without device_id and no collective
    before: rank ``starve_rank`` left with plan peak + ``above_plan_mb`` MiB. Created on
    both, raised, or blocked (the parent bounds it). The shim is imported for its plan
    only, never installed."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer.comm as comm

    fn = unwrap(comm.create_allreduce_fusion_workspace)
    kw = unified_kwargs(p["shape"], rank, world)
    plan = plan_for("unified", fn, kw)
    settle()
    emit("shim_state", wrapped=bool(getattr(comm.create_allreduce_fusion_workspace,
                                            "_self_flashinfer_safe_workspace", False)),
         env={k: v for k, v in os.environ.items() if k.startswith("FLASHINFER_SAFE_WORKSPACE")})
    starve = p["starve_rank"]
    leave = plan.peak_bytes + int(p["above_plan_mb"]) * MiB
    left = dev.hog().set(leave) if rank == starve else None
    snap = snapshot(dev, group, "before_call", starved=rank == starve, hog_left=left)
    emit("cold_point", above_plan_mb=p["above_plan_mb"], plan_peak=plan.peak_bytes,
         free_before=snap["free"], starved=rank == starve, nccl_warm=group.nccl_warm)
    ws = None
    with Call("create", unprotected=True) as c:
        ws = fn(**kw)
        c.result_note = describe(ws)
    emit("outcome", created=ws is not None, seconds=c.seconds, error=c.error)
    finish(None, linger=True, barrier=False)


# --------------------------------------------------------------------------- e: plan truth


def _handle_type(value) -> str:
    name = getattr(value, "name", str(value)).upper()
    if "FABRIC" in name:
        return "fabric"
    if "POSIX" in name:
        return "posix"
    return name.lower()


def _hid(handle):
    try:
        return int(handle)
    except Exception:
        return id(handle)


class _DriverRecorder:
    """Stands in for ``flashinfer.comm.mnnvl.cuda`` (the cuda-python driver module):
    records cuMemCreate/Release/Alloc/Free/Import/Map/AddressReserve, delegates all."""

    def __init__(self, real, events: list):
        self._real, self._events = real, events

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _log(self, api, result, **fields):
        err = result[0] if isinstance(result, tuple) and result else None
        ok = err is not None and int(err) == 0
        fields.update(api=api, ok=ok, err=getattr(err, "name", str(err)), t=time.perf_counter())
        self._events.append(fields)
        return ok

    def cuMemCreate(self, size, prop, flags):
        result = self._real.cuMemCreate(size, prop, flags)
        ok = int(result[0]) == 0
        self._log("cuMemCreate", result, size=int(size),
                  handle=_handle_type(prop.requestedHandleTypes),
                  hid=_hid(result[1]) if ok and len(result) > 1 else None)
        return result

    def cuMemRelease(self, handle):
        result = self._real.cuMemRelease(handle)
        self._log("cuMemRelease", result, hid=_hid(handle))
        return result

    def cuMemAlloc(self, size):
        result = self._real.cuMemAlloc(size)
        self._log("cuMemAlloc", result, size=int(size))
        return result

    def cuMemFree(self, ptr):
        result = self._real.cuMemFree(ptr)
        self._log("cuMemFree", result)
        return result

    def cuMemImportFromShareableHandle(self, *a):
        result = self._real.cuMemImportFromShareableHandle(*a)
        ok = int(result[0]) == 0
        self._log("cuMemImportFromShareableHandle", result,
                  hid=_hid(result[1]) if ok and len(result) > 1 else None)
        return result

    def cuMemAddressReserve(self, size, *a):
        result = self._real.cuMemAddressReserve(size, *a)
        self._log("cuMemAddressReserve", result, size=int(size))
        return result

    def cuMemMap(self, ptr, size, *a):
        result = self._real.cuMemMap(ptr, size, *a)
        self._log("cuMemMap", result, size=int(size))
        return result


class _CudartRecorder:
    """Stands in for ``flashinfer.comm.trtllm_ar.cudart`` (FlashInfer's ctypes libcudart)."""

    def __init__(self, real, events: list):
        self._real, self._events = real, events

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cudaMalloc(self, size):
        try:
            ptr = self._real.cudaMalloc(size)
        except Exception as exc:
            self._events.append({"api": "cudaMalloc", "size": int(size), "ok": False,
                                 "err": str(exc), "t": time.perf_counter()})
            raise
        self._events.append({"api": "cudaMalloc", "size": int(size), "ok": True, "err": "",
                             "t": time.perf_counter()})
        return ptr


class Recorder:
    """Swap the two module attributes FlashInfer allocates through, and back."""

    def __init__(self):
        self.events: list = []
        self._saved: list = []

    def __enter__(self):
        from flashinfer.comm import mnnvl, trtllm_ar

        self._saved = [(mnnvl, "cuda", mnnvl.cuda), (trtllm_ar, "cudart", trtllm_ar.cudart)]
        mnnvl.cuda = _DriverRecorder(mnnvl.cuda, self.events)
        trtllm_ar.cudart = _CudartRecorder(trtllm_ar.cudart, self.events)
        return self

    def __exit__(self, *exc):
        for module, name, obj in reversed(self._saved):
            setattr(module, name, obj)
        return False


def case_e(args):
    """Plan truth: every cuMemCreate/cuMemAlloc/cudaMalloc FlashInfer makes, next to
    the shim's plan, for several shapes and both entry points. No shim in this process."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer
    import flashinfer.comm as comm

    emit("shim_state", active=bool(getattr(comm.create_allreduce_fusion_workspace,
                                           "_self_flashinfer_safe_workspace", False)),
         flashinfer=flashinfer.__version__)
    with Call("warm-up: module + NCCL"):
        dev.preload_flashinfer_module()
        group.warm_nccl()
    settle()
    for item in p["shapes"]:
        name, entry, shape = item["name"], item["entry"], item["shape"]
        if entry == "unified":
            fn, kw = unwrap(comm.create_allreduce_fusion_workspace), unified_kwargs(shape, rank, world)
        else:  # "legacy": use_symm_dev_mem=True; "legacy-c": the default path (torch symm mem)
            fn, kw = legacy_function(), legacy_kwargs(shape, rank, world,
                                                      symm_dev_mem=entry != "legacy-c")
        try:
            plan = plan_for("unified" if entry == "unified" else "legacy", fn, kw)
            plan_json = plan.to_json() if hasattr(plan, "to_json") else {"passthrough": repr(plan)}
        except Exception as exc:  # noqa: BLE001 - recorded, the creation still runs
            plan_json = {"error": exc_info(exc)}
        before = snapshot(dev, group, f"{name}_before", shape_name=name)
        ws = None
        with Recorder() as rec:
            with Call(f"create {name}", shape_name=name) as c:
                ws = fn(**kw)
                c.result_note = describe(ws)
        after = snapshot(dev, group, f"{name}_after", shape_name=name)
        metadata = None
        if ws is not None:
            meta = ws[-1] if isinstance(ws, tuple) else getattr(ws, "metadata", {})
            metadata = {k: v for k, v in (meta or {}).items() if isinstance(v, (int, bool, str))}
        emit("plan_truth", name=name, entry=entry, shape=shape, plan=plan_json,
             recorded=rec.events, error=c.error, seconds=c.seconds, metadata=metadata,
             free_before=before["free"], free_after=after["free"],
             torch_allocated_delta=after["allocated"] - before["allocated"],
             torch_reserved_delta=after["reserved"] - before["reserved"])
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws)
            ws = None
        released = snapshot(dev, group, f"{name}_released", shape_name=name)
        emit("plan_truth_release", name=name, free_after_release=released["free"])
    finish(group)


# --------------------------------------------------------------------------- n: allocator C


def case_n(args):
    """Allocator C (torch symmetric memory, FlashInfer 0.7.4's legacy default path):
    free memory around each creation, and around each of its three buffers allocated
    alone through FlashInfer's own ``_alloc_symm_buffer_bytes`` (same sizes and dtypes),
    next to the plan's per-buffer bytes."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    import torch
    import flashinfer.comm  # noqa: F401
    from flashinfer.comm import trtllm_ar

    fn = legacy_function()
    with Call("warm-up: module + NCCL"):
        dev.preload_flashinfer_module()
        group.warm_nccl()
    group_name = torch.distributed.group.WORLD.group_name
    keep = None
    with Call("warm-up: one small symmetric buffer") as c:  # torch's first-use costs
        keep = trtllm_ar._alloc_symm_buffer_bytes(16, world, torch.int32, dev.torch_device,
                                                  group_name)
    settle()
    for item in p["shapes"]:
        name, shape = item["name"], item["shape"]
        kw = legacy_kwargs(shape, rank, world, symm_dev_mem=False)
        try:
            plan_json = plan_for("legacy", fn, kw).to_json()
        except Exception as exc:  # noqa: BLE001
            plan_json = {"error": exc_info(exc)}
        before = snapshot(dev, group, f"{name}_before")
        ws = None
        with Call(f"create {name}") as c:
            ws = fn(**kw)
        after = snapshot(dev, group, f"{name}_after")
        meta = ws[-1] if isinstance(ws, tuple) else {}
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws)
            ws = None
        released = snapshot(dev, group, f"{name}_released")
        lamport_dtype = torch.float32 if shape["dtype"] == "float32" else torch.float16
        buffers = []
        for label, size, dtype in (("buffer", meta.get("buffer_size"), torch.float32),
                                   ("flag", meta.get("flag_size"), torch.int32),
                                   ("lamport", meta.get("lamport_buffer_size"), lamport_dtype)):
            if not isinstance(size, int):
                continue
            b = snapshot(dev, group, f"{name}_{label}_before")
            ref = None
            with Call(f"{name}: {label} alone") as c2:
                ref = trtllm_ar._alloc_symm_buffer_bytes(-(-size // 16) * 16, world, dtype,
                                                         dev.torch_device, group_name)
            a = snapshot(dev, group, f"{name}_{label}_after")
            buffers.append({"label": label, "size": size, "free_delta": b["free"] - a["free"],
                            "error": c2.error})
            del ref
            collect()
        emit("alloc_c", name=name, shape=shape, plan=plan_json, error=c.error,
             seconds=c.seconds, metadata={k: v for k, v in meta.items()
                                          if isinstance(v, (int, bool, str))},
             free_before=before["free"], free_after=after["free"],
             free_released=released["free"], buffers=buffers,
             torch_reserved_delta=after["reserved"] - before["reserved"],
             signal_pad=_signal_pad())
    del keep
    finish(group)


def _signal_pad():
    try:
        from torch.distributed import _symmetric_memory

        return int(_symmetric_memory.get_signal_pad_size())
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {type(exc).__name__}"


# --------------------------------------------------------------------------- f: no leak


def case_f(args):
    """Free memory per rank around a vetoed call and around create + destroy; around the
    veto also what the rank itself holds (``own``: on a shared GPU free memory moves with
    the peer)."""
    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    dev.track_own()
    group = Group(args, dev)
    shim_install(on_veto="none")
    import flashinfer.comm as comm

    kw = unified_kwargs(p["shape"], rank, world)
    starve = p["starve_rank"]

    def cycle(tag: str):
        snapshot(dev, group, f"{tag}_before")
        ws = None
        with Call(f"create {tag}") as c:
            ws = comm.create_allreduce_fusion_workspace(**kw)
            c.result_note = describe(ws)
        snapshot(dev, group, f"{tag}_created", result=describe(ws), error=c.error)
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws, stages=lambda stage: snapshot(dev, group, f"{tag}_{stage}"))
            ws = None
        snapshot(dev, group, f"{tag}_released")

    snapshot(dev, group, "start")
    cycle("first")  # the process's first creation: NCCL init, module load, gloo group
    left = dev.hog().set(p["leave_mb"] * MiB) if rank == starve else None
    snapshot(dev, group, "veto_before", hog_left=left, own=dev.own())
    with Call("create vetoed") as c:
        result = comm.create_allreduce_fusion_workspace(**kw)
        c.result_note = describe(result)
    snapshot(dev, group, "veto_after", result=describe(result), error=c.error, own=dev.own())
    if rank == starve:
        dev.hog().release()
    snapshot(dev, group, "veto_hog_released")
    # the same call again, memory back: the shim caches a completed veto per arguments
    clear_report()
    with Call("create after veto, memory back") as c:
        result = comm.create_allreduce_fusion_workspace(**kw)
        c.result_note = describe(result)
    emit("sticky_veto", result=describe(result), error=c.error, report=last_report(),
         seconds=c.seconds)
    if result is not None:
        dev.sync()
        group.barrier()
        release_workspace(result)
    result = None
    clear_veto_cache()
    snapshot(dev, group, "sticky_checked")
    for i in range(int(p["cycles"])):
        cycle(f"cycle{i}")
    dev.empty_cache()
    snapshot(dev, group, "empty_cache")
    finish(group)


# --------------------------------------------------------------------------- g: overhead


def case_g(args):
    """Creation time with the shim on vs off (interleaved, same process), the probe and
    vote alone, and the veto decision latency."""
    import statistics  # noqa: F401  (the parent computes medians; kept for local use)

    p, rank, world = args.params, args.rank, args.world_size
    dev = make_device(rank)
    group = Group(args, dev)
    shim_install(on_veto="none")
    import flashinfer.comm as comm
    from flashinfer_safe_workspace import _decide

    wrapped = comm.create_allreduce_fusion_workspace
    original = unwrap(wrapped)
    kw = unified_kwargs(p["shape"], rank, world)

    def one(fn, label):
        clear_report()
        group.barrier()
        ws = None
        off = shim_off() if fn is original else None
        if off is not None:
            off.__enter__()
        try:
            with Call(label) as c:
                t0 = time.perf_counter()
                ws = fn(**kw)
                seconds = time.perf_counter() - t0
        finally:
            if off is not None:
                off.__exit__(None, None, None)
        report = last_report()
        if ws is not None:
            dev.sync()
            group.barrier()
            release_workspace(ws)
            ws = None
        collect()
        return {"seconds": seconds if c.error is None else None, "error": c.error,
                "probe_ms": report.get("probe_ms"), "vote_ms": report.get("vote_ms"),
                "decide_ms": report.get("elapsed_ms"), "vote": report.get("vote")}

    for label, fn in (("warm-up on", wrapped), ("warm-up off", original)):
        emit("warmup", label=label, **one(fn, label))
    settle()
    rows = []
    for i in range(int(p["n"])):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            row = one(wrapped if mode == "on" else original, f"{mode}#{i}")
            row.update(i=i, mode=mode)
            rows.append(row)
    emit("timings", rows=rows)
    starve = p["starve_rank"]
    left = dev.hog().set(p["leave_mb"] * MiB) if rank == starve else None
    snapshot(dev, group, "veto_before", hog_left=left)
    vrows = []
    for i in range(int(p["n_veto"])):
        clear_veto_cache()
        row = one(wrapped, f"veto#{i}")
        row.update(i=i)
        vrows.append(row)
    emit("veto_timings", rows=vrows)
    if rank == starve:
        dev.hog().release()
    finish(group)


CASES = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f,
         "g": case_g, "k": case_k, "n": case_n}

if __name__ == "__main__":
    run_main(CASES)
