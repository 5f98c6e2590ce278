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
    from ..planning import facts as _facts, plan as _plan, probe as _probe, rules

    settings = _config.current()
    if headroom_mb is None:  # auto: check sees no engine group, so the NCCL case counts
        from ..planning import headroom as _headroom

        head_bytes, head_why = _headroom.resolve(settings.headroom_mb, entry="unified",
                                                 backend=backend, group=None, comm_backend=None)
        headroom = head_bytes // MiB
    else:
        headroom, head_why = int(headroom_mb), "set"
    version = flashinfer_version or rules.flashinfer_version()
    r: dict = {"backend": backend, "world_size": world_size, "max_token_num": max_token_num,
               "hidden_dim": hidden_dim, "dtype": dtype, "device": device,
               "headroom_bytes": headroom * MiB, "headroom_why": head_why,
               "flashinfer_version": version,
               "prober": "simulated" if simulate_free_mb is not None else "cuda",
               "plan": None, "peak_bytes": None, "free_bytes": None, "total_bytes": None,
               "probe_ok": None, "probe_ms": None, "headroom_left_bytes": None, "notes": [],
               "facts": None}

    def done(status: str, why: str) -> dict:
        r["status"], r["reason"] = status, why
        r["exit_code"] = {"fits": FITS, "does-not-fit": DOES_NOT_FIT}.get(status, CANNOT_TELL)
        return r

    if version is None:
        return done("cannot-tell", "FlashInfer is not installed and --flashinfer-version not given")
    try:
        if rules.is_unknown(version):
            r["notes"].append(f"FlashInfer {version} is newer than the newest release mirrored "
                              f"({'.'.join(map(str, rules.NEWEST[:3]))}): planned with the "
                              "newest rules")
    except _plan.Unplanned as exc:
        return done("cannot-tell", str(exc))
    if simulate_free_mb is not None:
        prober = _probe.SimulatedDevice(int(simulate_free_mb) * MiB, device=device)
    else:
        prober = _probe.CudaProber()
    cc = _config.flashinfer_confidential_compute_override() == "1"
    try:  # the facts the shim plans with: prober, torch's signal pad, per-size Gmc
        facts = _facts.runtime_facts(prober, device=device, confidential_compute=cc,
                                     world_size=world_size)
    except _probe.ProbeUnavailable as exc:
        return done("cannot-tell", f"no usable CUDA driver or device: {exc}")
    except Exception as exc:  # the driver surprising us (bad ordinal, ...)
        return done("cannot-tell", f"could not query cuda:{device}: {type(exc).__name__}: {exc}")
    if backend == "auto":
        r["notes"].append("backend auto: resolved with this GPU's multicast support only; "
                          "FlashInfer asks every rank (one GPU without it picks trtllm)")
    req = _plan.Request(entry="unified", backend=backend, world_size=world_size, rank=rank,
                        max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=dtype)
    pad_source = _facts.signal_pad()[1]
    try:
        plan = rules.plan_for(req, facts, version)
    except _plan.Unplanned as exc:
        return done("cannot-tell", f"no allocation rule for this call: {exc}")
    except Exception as exc:  # noqa: BLE001 - our bug: report it, never crash
        return done("cannot-tell", f"planning failed: {type(exc).__name__}: {exc}")
    finally:  # after planning: the multicast answers it asked for are part of the facts
        r["facts"] = _facts.describe(facts, pad_source=pad_source,
                                     source=f"{prober.name} cuda:{device}")
    if isinstance(plan, _plan.PassThrough):
        return done("cannot-tell", f"FlashInfer rejects these arguments before allocating: "
                    f"{plan.reason}")
    r["plan"] = plan.to_json()
    r["plan_text"] = plan.describe()
    r["peak_bytes"] = plan.peak_bytes
    try:
        result = prober.probe(plan, headroom * MiB, device=device)
    except _probe.ProbeUnavailable as exc:
        return done("cannot-tell", f"no usable CUDA driver or device: {exc}")
    except Exception as exc:
        return done("cannot-tell", f"the probe failed: {type(exc).__name__}: {exc}")
    r["free_bytes"], r["total_bytes"] = result.free_bytes, result.total_bytes
    r["probe_ok"], r["probe_ms"] = result.ok, round(result.elapsed_s * 1000, 3)
    if result.free_bytes >= 0:
        r["headroom_left_bytes"] = result.free_bytes - plan.peak_bytes - headroom * MiB
    if result.ok:
        return done("fits", f"cuMemCreate of the whole plan ({plan.peak_bytes / MiB:.1f} MiB) plus "
                    f"{headroom} MiB headroom succeeded on cuda:{result.device}")
    if result.reason == _probe.OUT_OF_MEMORY:
        what = "the headroom" if result.failed_name == "headroom" else result.failed_name
        return done("does-not-fit", f"{what} ({result.failed_bytes / MiB:.1f} MiB) failed with "
                    f"{result.cuda_error_name or 'out of memory'} on cuda:{result.device}")
    return done("cannot-tell", f"the probe failed with {result.cuda_error_name or 'an error'} "
                f"(not out-of-memory) on {result.failed_name}")


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

