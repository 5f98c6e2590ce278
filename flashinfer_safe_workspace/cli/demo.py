"""The demo: N local ranks in a gloo group create the workspace through the shim.

With enough GPUs every rank probes its own GPU with real ``cuMemCreate`` and the
starved rank really is filled up; without, a simulated device (free bytes per rank)
stands in for the CUDA probe. Everything above the probe is the real code path, and
FlashInfer's real function is what gets called when the vote says yes.

Each rank reports what the decision logged (its decision line, read through the
documented line parser, and on a veto its WARNING's ``extra=`` fields): the demo keeps no
state of its own inside the product. The text report ends with a one-line verdict.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

from ..planning.plan import MiB

FLASHINFER_RAISED = "FlashInfer was called and raised"
ROOM_BYTES = 80 << 30  # a simulated rank with room has this much free
VERDICT_MAX = 160  # characters of the verdict line, at most


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> int:
    """Parent: start the ranks, collect one JSON line from each, print them. Exit 0 when
    every rank answered (a rank told to die excepted), 1 when one failed or hung, 2 when
    ``--mode gpu`` is asked for without a GPU per rank."""
    if args.mode == "gpu":
        found = _gpu_count()
        if found < args.world_size:
            print(f"{getattr(args, 'prog', 'flashinfer-safe-workspace')} demo: error: --mode "
                  f"gpu needs one CUDA GPU per rank ({args.world_size}); {found} here (--mode "
                  "simulated, or auto, runs without)", file=sys.stderr)
            return 2
    rows = _collect(args, _spawn(args))
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    else:
        _print_table(rows, args)
    return 0 if all(r.get("returncode") == 0 or r["rank"] == args.die_rank for r in rows) else 1


def _gpu_count() -> int:
    """CUDA devices torch sees here (0 without a driver or a CUDA build)."""
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no usable CUDA: none
        return 0


def _spawn(args) -> list:
    port = _free_port()
    env = dict(os.environ)
    from .. import _config

    env[_config.DEMO_PARENT] = str(os.getpid())  # only this process's children run a rank
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    procs = []
    for rank in range(args.world_size):
        cmd = [sys.executable, "-m", "flashinfer_safe_workspace", "_demo-rank",
               "--rank", str(rank), "--world-size", str(args.world_size),
               "--backend", args.backend, "--max-token-num", str(args.max_token_num),
               "--hidden-dim", str(args.hidden_dim), "--dtype", args.dtype,
               "--on-veto", args.on_veto, "--vote-timeout", str(args.vote_timeout),
               "--mode", args.mode, "--short-mb", str(args.short_mb)]
        for flag in ("starve_rank", "die_rank", "slow_rank"):
            value = getattr(args, flag)
            if value is not None:
                cmd += ["--" + flag.replace("_", "-"), str(value)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _collect(args, procs) -> list:
    """One row per rank, each wait bounded by the vote timeout plus a minute in all."""
    limit = args.vote_timeout + 60.0
    start = time.monotonic()
    rows = []
    for rank, proc in enumerate(procs):
        left = max(1.0, limit - (time.monotonic() - start))
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            rows.append({"rank": rank, "outcome": "killed: no answer within the demo's bound",
                         "returncode": None})
            continue
        line = next((l for l in reversed(out.splitlines()) if l.startswith("{")), None)
        if line is None:
            rows.append({"rank": rank, "outcome": "exited without a report",
                         "returncode": proc.returncode, "stderr_tail": err.strip()[-400:]})
        else:
            row = json.loads(line)
            row["returncode"] = proc.returncode
            rows.append(row)
    return rows


def _print_table(rows, args) -> None:
    print(f"flashinfer_safe_workspace demo: world_size={args.world_size} backend={args.backend} "
          f"T={args.max_token_num} H={args.hidden_dim} dtype={args.dtype} "
          f"starve_rank={args.starve_rank} on_veto={args.on_veto}")
    for row in rows:
        if "plan_bytes" not in row:
            tail = (row.get("stderr_tail") or "").strip().splitlines()
            print(f"  rank {row['rank']}: "
                  + (f"FlashInfer rejects this call before allocating ({row['rejected']}): "
                     "the shim lets it raise its own error -> " if row.get("rejected")
                     else "") + row["outcome"]
                  + (f" (last line: {tail[-1][:200]})" if tail else ""))
            continue
        print(f"  rank {row['rank']} [{row['device_kind']}]: {_sizes(row)}"
              + f", probe {row['probe']}, vote of ranks {row['ranks']}: {row['vote']}"
              f" (decision logged {row['elapsed_ms']:.1f} ms) -> {row['outcome']}"
              f" in {row['decision_ms']:.1f} ms")
    # the veto's message, once: every rank's says the same (a late rank adds that it followed)
    reason = next((r["reason"] for r in rows if r.get("reason")), "")
    if reason:
        print(f"  reason: {reason}")
    if any(r.get("device_kind") == "simulated" for r in rows):
        print(f"  [simulated]: no GPU per rank here, so a simulated device (cuda:N in the "
              "messages) answers each rank's memory probe; \"free\" is what the demo gives it: "
              f"{ROOM_BYTES / MiB:.1f} MiB with room, plan + headroom - {args.short_mb} MiB "
              "(--short-mb) when starved")
    if any(r.get("device_kind") == "simulated" and r.get("vote") == "yes" and str(
            r.get("outcome", "")).startswith(FLASHINFER_RAISED) for r in rows):
        print("  note: the vote passed, so FlashInfer's own function was called; without a GPU "
              "its error is expected here (the simulated device stands in for the probe only)")
    print(verdict(rows, args))


def verdict(rows, args) -> str:
    """The report's last line: what happened, in one line of at most ``VERDICT_MAX``
    characters."""
    text = "verdict: " + _verdict(rows, args)
    return text if len(text) <= VERDICT_MAX else text[:VERDICT_MAX - 3] + "..."


def _verdict(rows, args) -> str:
    times = [r["decision_ms"] for r in rows if isinstance(r.get("decision_ms"), (int, float))]
    took = (f" ({'all ' if len(times) == len(rows) else ''}answered within {max(times):.0f} ms)"
            if times else "")
    voted = [r for r in rows if r.get("vote") in ("yes", "no")]
    no = [r["rank"] for r in voted if r["vote"] == "no"]
    yes = [r["rank"] for r in voted if r["vote"] == "yes"]
    if rows and all(r.get("rejected") for r in rows):
        return ("FlashInfer rejects this call before allocating -> the shim let FlashInfer's "
                "own error through on every rank")
    if no and yes:
        return f"SPLIT: {_who(yes)} voted yes, {_who(no)} no; the shim exists to prevent this"
    if no:
        return (f"{_cause(rows, args)} -> no rank created the workspace; "
                f"{_did([r for r in voted if r['vote'] == 'no'], len(rows))}{took}")
    if yes:
        who = "every rank" if len(yes) == len(rows) else _who(yes)
        if all(str(r["outcome"]).startswith("created") for r in voted):
            return f"{who} voted yes -> {who} created the workspace{took}"
        why = (", as expected on a simulated device" if any(
            r.get("device_kind") == "simulated" for r in voted) else " (see above)")
        return f"{who} voted yes -> FlashInfer's own function was called and raised{why}{took}"
    return "no rank reported a decision (see the lines above)"


def _did(rows, of: int) -> str:
    """What the ranks that were told no did with the answer, in their order: the ``None``
    an engine takes its non-fused path on, or the exception (``--on-veto raise``)."""
    said: dict = {}
    for row in rows:
        raised = "WorkspaceVetoed" in str(row.get("outcome", ""))
        said.setdefault("raised WorkspaceVetoed" if raised else "took the non-fused path",
                        []).append(row["rank"])
    return ", ".join(("every rank" if len(ranks) == of else _who(ranks)) + " " + what
                     for what, ranks in said.items())


def _who(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


CAUSE_MAX = 80  # characters of the veto's own cause the verdict quotes, at most


def _cause(rows, args) -> str:
    """Why the vote said no: for memory, who was short and by how much as the veto itself
    says it (its WARNING's first sentence, ``fiws_summary``: the figure is the failing
    candidate's plan + headroom - free, which for ``backend=auto`` need not be the plan on
    the decision line); who died or was late; else the reason codes."""
    if any("OUT_OF_MEMORY" in (r.get("reasons") or []) for r in rows):
        causes = [str(r["summary"]).split(", so ", 1)[0] for r in rows
                  if ", so " in str(r.get("summary") or "")]
        cause = max(causes, key=lambda c: " short" in c, default="")  # one with its figure
        if cause and len(cause) <= CAUSE_MAX:
            return cause
        starved = [r["rank"] for r in rows if r.get("probe") == "no"] or [
            r["rank"] for r in rows if "OUT_OF_MEMORY" in (r.get("reasons") or [])]
        return f"{_who(starved)} ran out of GPU memory"  # the reason above says how far
    if args.die_rank is not None:
        return f"rank {args.die_rank} exited before the vote"
    if args.slow_rank is not None:
        return (f"rank {args.slow_rank} did not answer within the vote timeout "
                f"({args.vote_timeout:g} s)")
    codes = sorted({c for r in rows for c in (r.get("reasons") or [])})
    return f"the vote said no ({', '.join(codes) or 'no reason logged'})"


def _sizes(row) -> str:
    """Plan, headroom and free memory of one rank's line; a rank that never planned (it
    followed a decision made without it) has none of them: it says so."""
    if row["plan_bytes"] < 0:
        return "no plan (decided without it)"
    free = row["free_bytes"]
    return (f"plan {row['plan_bytes'] / MiB:.1f} MiB + headroom {row['headroom_bytes'] / MiB:.0f}"
            " MiB, free " + (f"{free / MiB:.1f} MiB" if free >= 0 else "-"))


def rank_main(args) -> int:
    """Child: one rank."""
    import torch

    import flashinfer_safe_workspace as fiws

    dist = _join(args)
    use_gpu = args.mode == "gpu" or (args.mode == "auto"
                                     and torch.cuda.device_count() >= args.world_size)
    fiws.install(on_veto=args.on_veto, vote_timeout=args.vote_timeout)
    heard = _Heard()  # what the decision logs: its decision line, a veto's WARNING
    headroom_bytes, kind, hog, rejected = _prepare_device(args, use_gpu)
    dist.barrier()
    if args.die_rank == args.rank:
        os._exit(3)  # dies before the vote
    if args.slow_rank == args.rank:
        time.sleep(args.vote_timeout + 2.0)
    start = time.perf_counter()
    outcome, reason = _create(args)
    decision_ms = (time.perf_counter() - start) * 1000
    heard.close()
    row = {"rank": args.rank, "device_kind": kind, "outcome": outcome,
           "decision_ms": decision_ms, "headroom_bytes": headroom_bytes,
           "reason": heard.veto or reason, "summary": heard.summary, "rejected": rejected}
    line = heard.decision()
    if line is not None:  # the decision line's fields; "outcome" stays what the call gave
        row.update({k: v for k, v in line.items() if k != "outcome"})
        row["vote"] = "yes" if line["outcome"] == "pass" else "no"
    if hog is not None:
        hog.release()
    print(json.dumps(row, default=str), flush=True)
    _stay_for_peers(dist, args)
    os._exit(0)  # skip process-group teardown: peers may have died on purpose


def _join(args):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                                        f"{os.environ['MASTER_PORT']}")
    return dist


def _prepare_device(args, use_gpu: bool):
    """(headroom bytes the shim will use, device kind, hog or None, FlashInfer's reason to
    reject the call or ""): on GPUs the starved rank's GPU is really filled; otherwise a
    simulated device stands in for the probe."""
    import flashinfer

    from .. import _config
    from ..planning import facts as _facts, plan as _plan, probe as _probe, request as _request
    from ..planning.simulated import SimulatedDevice

    rank, ws = args.rank, args.world_size
    req = _plan.Request("unified", args.backend, ws, rank, args.max_token_num, args.hidden_dim,
                        args.dtype)
    headroom_bytes = _request.headroom(_config.current(), req, {})[0]
    starved = args.starve_rank == rank
    if use_gpu:
        import torch

        torch.cuda.set_device(rank)
        facts = _facts.runtime_facts(_probe.CudaProber(), confidential_compute=False,
                                     world_size=ws)
        peak, rejected = _peak(req, facts, flashinfer.__version__)
        hog = _Hog(rank) if starved else None
        if hog is not None:
            hog.fill(leave=peak + headroom_bytes - args.short_mb * MiB)
        return headroom_bytes, f"cuda:{rank}", hog, rejected
    facts = _facts.runtime_facts(SimulatedDevice(1 << 40), confidential_compute=False,
                                 world_size=ws)
    peak, rejected = _peak(req, facts, flashinfer.__version__)
    free = max(peak + headroom_bytes - args.short_mb * MiB, 0) if starved else ROOM_BYTES
    _probe.set_prober(SimulatedDevice(free, device=rank))
    return headroom_bytes, "simulated", None, rejected


def _peak(req, facts, version):
    """(the plan's peak bytes, why there is none): 0 and FlashInfer's reason where it
    rejects the call before allocating (the shim lets it raise its own error, nothing to
    probe); 0 and "" where no rule covers it (the shim's vote says so)."""
    from ..planning import plan as _plan, rules

    try:
        plan = rules.plan_for(req, facts, version)
    except _plan.Unplanned:
        return 0, ""
    if isinstance(plan, _plan.PassThrough):
        return 0, plan.reason
    return plan.peak_bytes, ""


def _create(args):
    """(outcome, reason) of one create_allreduce_fusion_workspace call through the shim."""
    import torch
    import flashinfer.comm as comm

    import flashinfer_safe_workspace as fiws

    try:
        ws_obj = comm.create_allreduce_fusion_workspace(
            backend=args.backend, world_size=args.world_size, rank=args.rank,
            max_token_num=args.max_token_num, hidden_dim=args.hidden_dim,
            dtype=getattr(torch, args.dtype))
        if ws_obj is not None:
            ws_obj.destroy()
        return ("None (vetoed)" if ws_obj is None else f"created {type(ws_obj).__name__}"), ""
    except fiws.WorkspaceVetoed as exc:
        return "raised WorkspaceVetoed", str(exc)
    except Exception as exc:  # FlashInfer's own error, e.g. no CUDA on this machine
        return f"{FLASHINFER_RAISED} {type(exc).__name__}: {str(exc)[:120]}", ""


def _stay_for_peers(dist, args) -> None:
    """Rank 0's process hosts the store the decision goes through: it stays until every
    rank has read its answer (bounded: a rank that died on purpose never says so)."""
    try:
        import datetime

        store = dist.distributed_c10d._get_default_store()
        store.set(f"demo/done/{args.rank}", "1")
        if args.rank == 0:
            alive = [r for r in range(args.world_size) if r != args.die_rank]
            store.wait([f"demo/done/{r}" for r in alive], datetime.timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - the demo's own bookkeeping
        pass


class _Heard(logging.Handler):
    """Collects the shim's log records in this rank: the last decision line (parsed
    with the documented regex) and the veto WARNING's message (its ``extra=`` fields)."""

    def __init__(self):
        super().__init__(logging.INFO)
        from .._log import logger

        self.logger, self.lines, self.veto, self.summary = logger, [], "", ""
        self.level_before = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record) -> None:
        event = getattr(record, "fiws_event", None)
        if event == "decision":
            self.lines.append(record.getMessage())
        elif event == "veto":
            self.veto = str(getattr(record, "fiws_message", ""))
            self.summary = str(getattr(record, "fiws_summary", ""))

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()

    def decision(self):
        from .._log import parse_decision_lines

        found = parse_decision_lines("\n".join(self.lines))
        return found[-1] if found else None


class _Hog:
    """Fills a GPU with cuMemCreate so that only ``leave`` bytes stay free (GPU demo)."""

    def __init__(self, device: int):
        from ..planning.probe import CudaProber, checked

        self.prober, self.check, self.device, self.handles = CudaProber(), checked, device, []

    def fill(self, leave: int) -> None:
        import torch

        drv = self.prober.driver()
        prop = self.prober.allocation_prop(self.device, "posix", True)  # FlashInfer's allocation properties
        torch.cuda.init()
        gran = 2 * MiB
        while True:
            free, _ = torch.cuda.mem_get_info(self.device)
            extra = free - max(leave, 0)
            if extra < gran:
                break
            size = min(extra - extra % gran, 8 << 30)
            self.handles.append(self.check(drv.cuMemCreate(size, prop, 0)))

    def release(self) -> None:
        drv = self.prober.driver()
        for handle in self.handles:
            self.check(drv.cuMemRelease(handle))
        self.handles.clear()
