"""``check``: does a workspace fit on this GPU now? Plans it with the shared rules
(``rules.plan_for``) and the runtime facts (``_facts.runtime_facts``), exactly as the
shim plans it, and probes plan plus headroom the way the wrapper's probe does (never a
multicast object); talks to no other rank. Prints the facts it used.
"""

from __future__ import annotations

import time
from typing import Optional

from ..planning.plan import MiB

# check's exit codes (a launch script or CI gate reads these)
FITS = 0
DOES_NOT_FIT = 1
CANNOT_TELL = 2


def check_report(*, backend: str, world_size: int, max_token_num: int, hidden_dim: int,
                 dtype: str, headroom_mb: Optional[int] = None, device: int = 0,
                 rank: int = 0, flashinfer_version: Optional[str] = None,
                 simulate_free_mb: Optional[int] = None) -> dict:
    """Plan one unified-API workspace for this GPU and probe it; never raises.

    ``status`` is ``fits`` / ``does-not-fit`` / ``cannot-tell``; ``exit_code`` the
    matching 0 / 1 / 2.
    """
    from .. import _config
    from ..planning import rules

    headroom, head_why = _headroom_mib(_config.current(), backend, headroom_mb)
    r: dict = {"backend": backend, "world_size": world_size, "max_token_num": max_token_num,
               "hidden_dim": hidden_dim, "dtype": dtype, "device": device, "rank": rank,
               "headroom_bytes": headroom * MiB, "headroom_why": head_why,
               "flashinfer_version": flashinfer_version or rules.flashinfer_version(),
               "prober": "simulated" if simulate_free_mb is not None else "cuda",
               "plan": None, "peak_bytes": None, "free_bytes": None, "total_bytes": None,
               "probe_ok": None, "probe_ms": None, "headroom_left_bytes": None, "notes": [],
               "facts": None}
    r["status"], r["reason"] = _answer(r, simulate_free_mb)
    r["exit_code"] = {"fits": FITS, "does-not-fit": DOES_NOT_FIT}.get(r["status"], CANNOT_TELL)
    return r


def _headroom_mib(settings, backend: str, headroom_mb: Optional[int]):
    """(MiB, why): the argument, or auto as check sees it (no engine group: the NCCL case)."""
    if headroom_mb is not None:
        return int(headroom_mb), "set"
    from ..planning import headroom as _headroom

    head_bytes, head_why = _headroom.resolve(settings.headroom_mb, entry="unified",
                                             backend=backend, group=None, comm_backend=None)
    return head_bytes // MiB, head_why


def _answer(r: dict, simulate_free_mb: Optional[int]):
    """(status, reason), filling ``r`` with the facts, the plan and the probe's figures."""
    from ..planning import plan as _plan, probe as _probe, rules
    from ..planning.simulated import SimulatedDevice

    version = r["flashinfer_version"]
    if version is None:
        return "cannot-tell", "FlashInfer is not installed and --flashinfer-version not given"
    try:
        if rules.is_unknown(version):
            r["notes"].append(f"FlashInfer {version} is {rules.unverified_why(version)}: "
                              f"planned with the rules of {rules.range_of(version)}, not "
                              "verified")
    except _plan.Unplanned as exc:
        return "cannot-tell", str(exc)
    device = r["device"]
    if simulate_free_mb is not None:
        prober = SimulatedDevice(int(simulate_free_mb) * MiB, device=device)
    else:
        prober = _probe.CudaProber()
    plan = _plan_here(r, prober)
    if isinstance(plan, tuple):
        return plan
    r["plan"], r["plan_text"], r["peak_bytes"] = plan.to_json(), plan.describe(), plan.peak_bytes
    return _probe_plan(r, prober, plan)


def _plan_here(r: dict, prober):
    """The plan with this device's facts (recorded in ``r``), or (status, reason)."""
    from .. import _config
    from ..planning import facts as _facts, plan as _plan, probe as _probe, rules

    device = r["device"]
    cc = _config.flashinfer_confidential_compute_override() == "1"
    try:  # the facts the shim plans with: prober, torch's signal pad, per-size Gmc
        facts = _facts.runtime_facts(prober, device=device, confidential_compute=cc,
                                     world_size=r["world_size"])
    except _probe.ProbeUnavailable as exc:
        return "cannot-tell", f"no usable CUDA driver or device: {exc}"
    except Exception as exc:  # the driver surprising us (bad ordinal, ...)
        return "cannot-tell", f"could not query cuda:{device}: {type(exc).__name__}: {exc}"
    if r["backend"] == "auto":
        r["notes"].append("backend auto: resolved with this GPU's multicast support only; "
                          "FlashInfer asks every rank (one GPU without it picks trtllm)")
    req = _plan.Request(entry="unified", backend=r["backend"], world_size=r["world_size"],
                        rank=r["rank"], max_token_num=r["max_token_num"],
                        hidden_dim=r["hidden_dim"], dtype=r["dtype"])
    pad_source = _facts.signal_pad()[1]
    try:
        plan = rules.plan_for(req, facts, r["flashinfer_version"])
    except _plan.Unplanned as exc:
        return "cannot-tell", f"no allocation rule for this call: {exc}"
    except Exception as exc:  # noqa: BLE001 - our bug: report it, never crash
        return "cannot-tell", f"planning failed: {type(exc).__name__}: {exc}"
    finally:  # after planning: the multicast answers it asked for are part of the facts
        r["facts"] = _facts.describe(facts, pad_source=pad_source,
                                     source=f"{prober.name} cuda:{device}")
    if isinstance(plan, _plan.PassThrough):
        return "cannot-tell", f"FlashInfer rejects these arguments before allocating: {plan.reason}"
    return plan


def _probe_plan(r: dict, prober, plan):
    """Probe plan plus headroom the way the wrapper's probe does; (status, reason)."""
    from ..planning import probe as _probe

    headroom = r["headroom_bytes"]
    try:
        result = prober.probe(plan, headroom, device=r["device"])
    except _probe.ProbeUnavailable as exc:
        return "cannot-tell", f"no usable CUDA driver or device: {exc}"
    except Exception as exc:
        return "cannot-tell", f"the probe failed: {type(exc).__name__}: {exc}"
    r["free_bytes"], r["total_bytes"] = result.free_bytes, result.total_bytes
    r["probe_ok"], r["probe_ms"] = result.ok, round(result.elapsed_s * 1000, 3)
    if result.free_bytes >= 0:
        r["headroom_left_bytes"] = result.free_bytes - plan.peak_bytes - headroom
    if result.ok:
        return "fits", (f"cuMemCreate of the whole plan ({plan.peak_bytes / MiB:.1f} MiB) plus "
                        f"{headroom // MiB} MiB headroom succeeded on cuda:{result.device}")
    failed = result.failed
    if result.reason == _probe.OUT_OF_MEMORY:
        what = "the headroom" if failed.name == "headroom" else failed.name
        return "does-not-fit", (f"{what} ({failed.size / MiB:.1f} MiB) failed with "
                                f"{failed.cuda_error_name or 'out of memory'} on "
                                f"cuda:{result.device}")
    return "cannot-tell", (f"the probe failed with {failed.cuda_error_name or 'an error'} "
                           f"(not out-of-memory) on {failed.name}")


def format_check(r: dict) -> str:
    gib = lambda b: "-" if b is None or b < 0 else f"{b / (1 << 30):.2f} GiB"  # noqa: E731
    head = (f"check: backend={r['backend']} world_size={r['world_size']} T={r['max_token_num']} "
            f"H={r['hidden_dim']} dtype={r['dtype']} on cuda:{r['device']} ({r['prober']}), "
            f"FlashInfer {r['flashinfer_version']}")
    out = [head]
    if r.get("facts"):
        from ..planning.facts import format_facts

        out.append("  " + format_facts(r["facts"]))
    if r.get("plan_text"):
        out += ["  " + line for line in r["plan_text"].splitlines()]
    if r["probe_ok"] is not None:
        out.append(f"  free {gib(r['free_bytes'])} of {gib(r['total_bytes'])}; need "
                   f"{r['peak_bytes'] / MiB:.1f} MiB + headroom {r['headroom_bytes'] / MiB:.0f} MiB"
                   f" ({r.get('headroom_why', 'set')});"
                   f" probe {'ok' if r['probe_ok'] else 'FAILED'} ({r['probe_ms']:.2f} ms)")
        if r["headroom_left_bytes"] is not None:
            out.append(f"  left after plan and headroom: {r['headroom_left_bytes'] / MiB:.1f} MiB")
    for note in r["notes"]:
        out.append(f"  note: {note}")
    out.append(f"  result: {r['status']} (exit {r['exit_code']}): {r['reason']}")
    return "\n".join(out)


def run_check(args) -> int:
    import json

    start = time.perf_counter()
    r = check_report(backend=args.backend, world_size=args.world_size,
                     max_token_num=args.max_token_num, hidden_dim=args.hidden_dim,
                     dtype=args.dtype, headroom_mb=args.headroom_mb, device=args.device,
                     rank=args.rank, flashinfer_version=args.flashinfer_version,
                     simulate_free_mb=args.simulate_free_mb)
    r["elapsed_ms"] = round((time.perf_counter() - start) * 1000, 3)
    if args.json:
        r.pop("plan_text", None)
        print(json.dumps(r, indent=2, sort_keys=True, default=str))
    else:
        print(format_check(r))
    return r["exit_code"]

