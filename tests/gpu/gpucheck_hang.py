"""Case w (issue 23): the hang itself on one GPU, with FlashInfer 0.7.2.post1, with and
without the shim. Parent side: start the two ranks (``gpucheck_hang_rank.py``), bound the
run, and turn the events into rows and checks.

Two ranks share cuda:0 over a gloo WORLD. The peer (rank 1) calls
``create_allreduce_fusion_workspace(backend="trtllm")`` first; the starved rank (rank 0)
waits until the peer has entered the creation (observed by a profile hook in the peer,
see the rank script), then takes the GPU's memory, then calls. Each rank stays alive
after its answer. Without the shim, 0.7.2.post1 (allocator B3: no vote around
cuMemCreate) lets rank 0 raise at its first cuMemCreate while the peer waits in the fd
exchange's all-gather: the peer is still blocked at the bound (75 s by default) and is
killed. With the shim (``FLASHINFER_SAFE_WORKSPACE=1`` through the installed ``.pth``,
nothing else changed), both ranks get None and neither enters FlashInfer.

Imports neither torch nor FlashInfer (the parent must not create a CUDA context).
"""

from __future__ import annotations

import os
import tempfile

from gpucheck_cases import (
    E1,
    HANG_SCRIPT,
    Ctx,
    _outcome_of_call,
    _pth_env,
    check,
    describe_outcome,
    events,
    finish_case,
    first,
    rank_errors,
    run_pair,
)

FLASHINFER = "0.7.2.post1"  # the release vLLM 0.33 and SGLang 0.5.23 pin
BOUND_S = 75.0
VARIANTS = {"on": "with the shim", "off": "without the shim"}
# Where the peer counts as "inside the creation" (the rank script's sync targets):
# without the shim, FlashInfer's fd exchange (0.7.2.post1: after the peer's first
# cuMemCreate and export, at its first collective); with it, the shim's agreement (after
# the peer's probe and checks, waiting for the other rank's record).
SYNC_TARGETS = {"off": ["flashinfer.comm.fd_exchange:exchange_fds"],
                "on": ["flashinfer_safe_workspace.agreement.*:vote"]}
FAKE_SYNC_TARGETS = {"off": ["gpucheck_fake:fake_exchange_fds"], "on": SYNC_TARGETS["on"]}
# FlashInfer's own creation functions: a rank that enters one of them entered FlashInfer.
FI_TARGETS = ["flashinfer.comm.allreduce:create_allreduce_fusion_workspace",
              "flashinfer.comm.trtllm_ar:trtllm_create_ipc_workspace_for_all_reduce_fusion"]
DEFAULTS = {"variants": ["on", "off"], "shape": E1, "starve_rank": 0, "leave_mb": 16,
            "bound_s": BOUND_S, "vote_timeout_s": 120.0, "expect_flashinfer": FLASHINFER}


def hang_params(ctx: Ctx, variant: str, cfg: dict, signal_dir: str) -> dict:
    bound = float(cfg["bound_s"])
    return {"shape": cfg["shape"], "starve_rank": cfg["starve_rank"],
            "leave_mb": cfg["leave_mb"], "signal_dir": signal_dir,
            "sync_targets": (FAKE_SYNC_TARGETS if ctx.fake else SYNC_TARGETS)[variant],
            "fi_targets": FI_TARGETS, "sync_timeout_s": min(30.0, bound / 2),
            "dump_after_s": max(bound - 3.0, 1.0), "linger": True,
            "expect_flashinfer": None if ctx.fake else cfg["expect_flashinfer"]}


def read_stacks(signal_dir: str, world: int, limit: int = 8000) -> dict:
    """The faulthandler dumps the ranks wrote at the bound (empty if they answered)."""
    out = {}
    for rank in range(world):
        try:
            with open(os.path.join(signal_dir, f"stacks-r{rank}.txt")) as fh:
                text = fh.read()
        except OSError:
            continue
        if text.strip():
            out[rank] = text[-limit:]
    return out


def outcome_text(o: dict, bound: float) -> str:
    """describe_outcome, with sub-second times in milliseconds."""
    seconds = o.get("seconds")
    if o.get("kind") in ("returned", "raised") and isinstance(seconds, float) and seconds < 1:
        what = (f"returned ({o.get('note')})" if o["kind"] == "returned"
                else f"raised {str(o.get('type')).rsplit('.', 1)[-1]}")
        return f"{what} after {seconds * 1000:.0f} ms"
    return describe_outcome(o, bound)


def rank_row(run: dict, rank: int, variant: str, bound: float) -> dict:
    o = _outcome_of_call(run, rank, "create")
    ans = first(run, rank, "answer") or {}
    state = first(run, rank, "state") or {}
    snap = first(run, rank, "snap", where="before") or {}
    hits = events(run, rank, "entered")
    answered = o.get("kind") in ("returned", "raised")
    return {"variant": variant, "rank": rank, "starved": bool(snap.get("starved")),
            "free_before": snap.get("free"), "outcome": o, "text": outcome_text(o, bound),
            "seconds": o.get("seconds") if answered else o.get("blocked_s"),
            "blocked_at_bound": o.get("kind") == "blocked",
            "entered_flashinfer": [h["target"] for h in hits if h.get("kind") == "flashinfer"],
            "entered_sync": next((h for h in hits if h.get("kind") == "sync"), None),
            "alive_after_answer": (bool(run["ranks"][rank]["killed"]) if answered else None),
            "flashinfer": state.get("flashinfer"), "shim_imported": state.get("shim_imported"),
            "shim_at_start": state.get("fiws_imported_at_start"), "wrapped": state.get("wrapped"),
            "wall_start": ans.get("wall_start"), "wall_end": ans.get("wall_end"),
            "decisions": ans.get("decisions") or [], "warnings": (ans.get("warnings") or [])[:3],
            "error": ((ans.get("error") or {}).get("msg") or "")[:400]}


def sync_facts(run: dict, starve: int, peer: int) -> dict:
    """When the starved rank took the memory, relative to the peer's entry."""
    sync = first(run, starve, "sync") or {}
    hog = first(run, starve, "hog") or {}
    hit = next((h for h in events(run, peer, "entered") if h.get("kind") == "sync"), None)
    peer_end = (first(run, peer, "answer") or {}).get("wall_end")
    out = {"observed": bool(sync.get("observed")), "waited_s": sync.get("waited_s"),
           "peer_target": (hit or {}).get("target"), "peer_stack": (hit or {}).get("stack"),
           "hog_left": hog.get("left"), "hog_s": (hog["wall_end"] - hog["wall_start"])
           if hog else None}
    if hit and hog:
        out["hog_after_entry_s"] = hog["wall_start"] - hit["t"]
        # the peer was still inside its call when the memory was gone
        out["peer_inside_at_hog"] = peer_end is None or peer_end > hog["wall_end"]
    return out


def _common_checks(variant: str, rows: list, sync: dict, cfg: dict, ctx: Ctx) -> list:
    name = VARIANTS[variant]
    want = None if ctx.fake else cfg["expect_flashinfer"]
    checks = [check(f"{name}: FlashInfer {want or '(any, fake)'} on every rank",
                    bool(rows) and all(want is None or r["flashinfer"] == want for r in rows),
                    "; ".join(f"rank {r['rank']}: {r['flashinfer']}" for r in rows))]
    if variant == "on":
        ok = all(r["shim_at_start"] and r["wrapped"] for r in rows)
        what = "the shim was active from the .pth alone (FLASHINFER_SAFE_WORKSPACE=1)"
    else:
        ok = all(r["shim_imported"] is False and r["wrapped"] is False for r in rows)
        what = "the shim was neither imported nor wrapping"
    checks.append(check(f"{name}: {what}", bool(rows) and ok,
                        "; ".join(f"rank {r['rank']}: imported {r['shim_imported']}, wrapped "
                                  f"{r['wrapped']}" for r in rows)))
    checks.append(check(
        f"{name}: the starved rank took the memory only after the peer entered "
        f"{(sync.get('peer_target') or '?').rsplit(':', 1)[-1]}, while the peer was inside its call",
        sync["observed"] and (sync.get("hog_after_entry_s") or -1) >= 0
        and bool(sync.get("peer_inside_at_hog")),
        f"waited {sync.get('waited_s')} s for {sync.get('peer_target')}; memory taken "
        f"{sync.get('hog_after_entry_s')} s after the entry; left {sync.get('hog_left')} B"))
    answered = [r for r in rows if r["alive_after_answer"] is not None]
    checks.append(check(f"{name}: every rank that answered was still alive when the run ended",
                        bool(answered) and all(r["alive_after_answer"] for r in answered),
                        "; ".join(f"rank {r['rank']}: {r['alive_after_answer']}" for r in answered)))
    return checks


def variant_checks(variant: str, rows: list, sync: dict, stacks: dict, cfg: dict,
                   ctx: Ctx) -> list:
    checks = _common_checks(variant, rows, sync, cfg, ctx)
    bound = float(cfg["bound_s"])
    starved = [r for r in rows if r["starved"]]
    peers = [r for r in rows if not r["starved"]]
    detail = "; ".join(f"rank {r['rank']}: {r['text']}" for r in rows)
    if variant == "off":
        checks.append(check("without the shim: the starved rank's FlashInfer call raised",
                            bool(starved) and all(r["outcome"].get("kind") == "raised"
                                                  for r in starved), detail))
        checks.append(check(f"without the shim: the peer was still blocked at the {bound:.0f} s "
                            "bound", bool(peers) and all(r["blocked_at_bound"] for r in peers),
                            detail))
        where = [r["rank"] for r in peers if "exchange_fds" in stacks.get(r["rank"], "")
                 or "fake_exchange_fds" in stacks.get(r["rank"], "")]
        checks.append(check("without the shim: the blocked peer's stack at the bound is in "
                            "FlashInfer's fd exchange", bool(peers) and len(where) == len(peers),
                            f"stack dumps from ranks {sorted(stacks)}", required=False))
        return checks
    limit = float(cfg["vote_timeout_s"])
    checks.append(check(f"with the shim: None on every rank, each within the {limit:.0f} s vote "
                        "timeout", bool(rows) and all(
                            r["outcome"].get("kind") == "returned"
                            and r["outcome"].get("note") == "None" and r["seconds"] < limit
                            for r in rows), detail))
    checks.append(check("with the shim: no rank entered FlashInfer",
                        bool(rows) and not any(r["entered_flashinfer"] for r in rows),
                        "; ".join(f"rank {r['rank']}: {r['entered_flashinfer'] or 'no'}"
                                  for r in rows)))
    lines = [(r["decisions"] or [{}])[-1] for r in rows]
    checks.append(check("with the shim: a decision line outcome=veto on every rank",
                        bool(rows) and all(str(x.get("outcome")) == "veto" for x in lines),
                        "; ".join(f"rank {r['rank']}: outcome={x.get('outcome')} "
                                  f"check={x.get('check')}" for r, x in zip(rows, lines))))
    return checks


def summarise(rows: list) -> str:
    parts = []
    for variant in ("off", "on"):
        got = [r for r in rows if r["variant"] == variant]
        if got:
            parts.append(VARIANTS[variant] + ": " + ", ".join(
                f"rank {r['rank']} ({'starved' if r['starved'] else 'peer'}) {r['text']}"
                for r in got))
    return "; ".join(parts) or "no rows"


def case_w(ctx: Ctx) -> dict:
    cfg = dict(DEFAULTS)
    cfg.update(ctx.overrides.get("w", {}))
    bound = float(cfg["bound_s"])
    runs, rows, checks, data = [], [], [], {"params": cfg, "variants": {}}
    for variant in cfg["variants"]:
        signal_dir = tempfile.mkdtemp(prefix=f"w-{variant}-", dir=ctx.workdir())
        params = hang_params(ctx, variant, cfg, signal_dir)
        env = _pth_env(ctx) if variant == "on" else {}
        if ctx.fake:
            env["GPUCHECK_FAKE_ALLOCATOR"] = "B3"
        run = run_pair(ctx, "w", params, timeout=bound + 60.0, script=HANG_SCRIPT,
                       env_extra=env, call_bound=bound, tag=f"w-{variant}")
        runs.append(run)
        got = [rank_row(run, r, variant, bound) for r in range(ctx.world_size)]
        starve = int(cfg["starve_rank"])
        sync = sync_facts(run, starve, next(r for r in range(ctx.world_size) if r != starve))
        stacks = read_stacks(signal_dir, ctx.world_size)
        rows += got
        checks += variant_checks(variant, got, sync, stacks, cfg, ctx)
        data["variants"][variant] = {"sync": sync, "stacks": stacks, "wall_s": run["wall_s"],
                                     "hang": run.get("hang"), "timed_out": run["timed_out"]}
    data["rows"] = rows
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, data, runs, summarise(rows), errors)
