"""Parent side of the GPU check: start two rank processes per run, read their JSON
lines live, bound every run (and every blocking call inside it), and turn the events
into per-case data and checks.

Used by ``scripts/gpu-check`` (all cases, one command on the GPU host) and by
``tests/gpu/test_gpu_cases.py`` (the same claims as pytest tests). Imports neither
torch nor FlashInfer: the parent must not create a CUDA context of its own.

Every case returns a dict: ``status`` (pass | fail | error | skipped), ``summary``,
``checks`` ([{name, ok, detail}]), ``data`` (what the report shows) and ``runs`` (raw
events and stderr tails of each rank process).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TREE_PACKAGE = os.path.join(ROOT, "flashinfer_safe_workspace")  # the working tree's copy
RANK_SCRIPT = os.path.join(HERE, "gpucheck_rank.py")
PTH_SCRIPT = os.path.join(HERE, "gpucheck_pth_rank.py")
HANG_SCRIPT = os.path.join(HERE, "gpucheck_hang_rank.py")  # case w (gpucheck_hang)
PREFIX = "@@GPUCHECK "
MiB = 1 << 20

# NVLink multicast stays off in every process we start (host rule).
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}

# Shapes (world size 2). E1 is the configuration measured in the reference, section 9.
E1 = {"T": 2048, "H": 4096, "dtype": "bfloat16"}
FP32 = {"T": 2048, "H": 5120, "dtype": "float32"}
WIDE = {"T": 4096, "H": 12288, "dtype": "bfloat16"}
ODD = {"T": 128, "H": 2880, "dtype": "float16"}
CLAMPED = {"T": 32768, "H": 16384, "dtype": "bfloat16"}  # ws*T*H*2 = 2 GiB > MAX_COMM_SIZE
LEGACY = {"T": 1024, "H": 8192, "dtype": "bfloat16"}

PLAN_TRUTH_SHAPES = [
    {"name": "E1 bf16 T2048 H4096", "entry": "unified", "shape": E1},
    {"name": "fp32 T2048 H5120", "entry": "unified", "shape": FP32},
    {"name": "bf16 T4096 H12288", "entry": "unified", "shape": WIDE},
    {"name": "fp16 T128 H2880", "entry": "unified", "shape": ODD},
    {"name": "legacy bf16 T1024 H8192 use_symm_dev_mem", "entry": "legacy", "shape": LEGACY},
    {"name": "bf16 T32768 H16384 (Lamport clamped)", "entry": "unified", "shape": CLAMPED},
]
SWEEP_SHAPES = [("E1 bf16 T2048 H4096", E1), ("fp32 T2048 H5120", FP32),
                ("fp16 T128 H2880", ODD), ("bf16 T4096 H12288", WIDE)]
SWEEP_DELTAS_MB = (-2, 0, 2)
SWEEP_HEADROOM_MB = 0


@dataclasses.dataclass
class Ctx:
    """How to run: fake (CPU) or real, the bounds, the global deadline, the log."""

    fake: bool = False
    python: str = sys.executable
    world_size: int = 2
    hang_bound_s: float = 60.0  # case c: a blocked rank is killed after this
    sweep_hang_bound_s: float = 40.0  # case d (FlashInfer's fd exchange has 30 s timeouts)
    cold_hang_bound_s: float = 30.0  # cases k, l: a blocked creation is killed after this
    call_bound_s: float = 90.0  # any other call that blocks longer is a hang
    shared: dict = dataclasses.field(default_factory=dict)  # findings one case hands the next
    deadline: float = float("inf")  # time.monotonic() by which everything must be over
    log: Optional[Callable[[str], None]] = None
    overrides: dict = dataclasses.field(default_factory=dict)  # per-case params (tests)
    runs: list = dataclasses.field(default_factory=list)  # every run of the current case
    # one-GPU profile: every rank on cuda:0 over a gloo WORLD (NCCL refuses two ranks on
    # one GPU; torch symmetric memory too)
    shared_device: bool = False
    _workdir: Optional[str] = None

    @property
    def ranks_per_device(self) -> int:
        """Rank processes whose allocations one device's free memory shows (the fakes
        give every rank a device of its own)."""
        return self.world_size if self.shared_device and not self.fake else 1

    def workdir(self) -> str:
        """A folder outside the repository: the rank processes' cwd (so nothing imports
        the working tree's package) and the home of the engine-named caller stubs."""
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="gpucheck-")
            write_caller_stubs(self._workdir)
        return self._workdir

    def cleanup(self) -> None:
        if self._workdir is not None:
            import shutil

            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def bounded(self, timeout: float) -> float:
        return max(1.0, min(timeout, self.remaining() - 2.0))


# --------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CALLER_STUB = '''"""Written by the GPU check: a caller whose module name is an engine's."""


def create(fn, kwargs):
    return fn(**kwargs)
'''


def write_caller_stubs(folder: str) -> None:
    """``sglang/fiws_probe_caller.py`` and ``vllm/fiws_probe_caller.py`` under ``folder``:
    real module files, so a call made from them has an engine's module name."""
    for engine in ("sglang", "vllm"):
        pkg = os.path.join(folder, "callers", engine)
        os.makedirs(pkg, exist_ok=True)
        with open(os.path.join(pkg, "__init__.py"), "w") as fh:
            fh.write("")
        with open(os.path.join(pkg, "fiws_probe_caller.py"), "w") as fh:
            fh.write(CALLER_STUB)


def rank_env(ctx: Ctx, extra: Optional[dict] = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env.update(NVLS_OFF)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONSAFEPATH"] = "1"  # no script folder or cwd on sys.path: the installed wheel only
    for key in ("GPUCHECK_FAKE", "GPUCHECK_SHARED_DEVICE", "GPUCHECK_WORLD_BACKEND"):
        env.pop(key, None)
    if ctx.shared_device:
        env["GPUCHECK_SHARED_DEVICE"] = "1"
        env["GPUCHECK_WORLD_BACKEND"] = "gloo"
    if ctx.fake:
        env["GPUCHECK_FAKE"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    if extra:
        env.update(extra)
    for key, value in NVLS_OFF.items():  # never overridable
        env[key] = value
    return env


class _Rank:
    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank, self.proc = rank, proc
        self.events: list = []
        self.recv: list = []  # parent monotonic receive time per event
        self.stderr = collections.deque(maxlen=300)
        self.stdout_other = collections.deque(maxlen=50)
        self.lock = threading.Lock()
        self.killed = False

    def done(self) -> bool:
        with self.lock:
            return any(e.get("ev") == "done" for e in self.events)

    def open_calls(self) -> list:
        """(label, receive time) of call_start events with no call_end yet."""
        with self.lock:
            open_: dict = {}
            for ev, at in zip(self.events, self.recv):
                if ev.get("ev") == "call_start":
                    open_[ev.get("label")] = at
                elif ev.get("ev") == "call_end":
                    open_.pop(ev.get("label"), None)
            return list(open_.items())


def _read_stdout(r: _Rank) -> None:
    for line in r.proc.stdout:
        if line.startswith(PREFIX):
            try:
                ev = json.loads(line[len(PREFIX):])
            except ValueError:
                r.stdout_other.append(line.rstrip())
                continue
            with r.lock:
                r.events.append(ev)
                r.recv.append(time.monotonic())
        else:
            r.stdout_other.append(line.rstrip())


def _read_stderr(r: _Rank, log, tag: str) -> None:
    for line in r.proc.stderr:
        r.stderr.append(line.rstrip())
        if log is not None:
            log(f"[{tag} r{r.rank}] {line.rstrip()}")


def run_pair(ctx: Ctx, case: str, params: dict, *, timeout: float, script: str = RANK_SCRIPT,
             env_extra: Optional[dict] = None, call_bound: Optional[float] = None,
             tag: str = "") -> dict:
    """Run ``case`` on ``ctx.world_size`` rank processes; never longer than ``timeout``.

    A rank inside a call (call_start without call_end) for longer than ``call_bound``
    is reported as blocked, and every rank is killed. A rank that exits without
    reporting done gives its peers 15 s before they are killed."""
    timeout = ctx.bounded(timeout)
    call_bound = call_bound if call_bound is not None else ctx.call_bound_s
    port = free_port()
    env = rank_env(ctx, env_extra)
    tag = tag or case
    ranks = []
    start = time.monotonic()
    for rank in range(ctx.world_size):
        cmd = [ctx.python, script, "--case", case, "--rank", str(rank),
               "--world-size", str(ctx.world_size), "--port", str(port),
               "--params", json.dumps(params)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, env=env,
                                start_new_session=True, cwd=ctx.workdir())
        r = _Rank(rank, proc)
        ranks.append(r)
        for target, a in ((_read_stdout, (r,)), (_read_stderr, (r, ctx.log, tag))):
            threading.Thread(target=target, args=a, daemon=True).start()
    hang, timed_out, ended_early = None, False, None
    while True:
        now = time.monotonic()
        states = [(r.done(), r.proc.poll() is not None) for r in ranks]
        if all(d or x for d, x in states):
            break
        blocked = []
        for r in ranks:
            for label, at in r.open_calls():
                if now - at > call_bound:
                    blocked.append({"rank": r.rank, "label": label, "blocked_s": now - at})
        if blocked:
            # report every rank still inside a call, not only the first past the bound
            hang = {"bound_s": call_bound, "ranks": [
                {"rank": r.rank, "label": label, "blocked_s": now - at}
                for r in ranks for label, at in r.open_calls()]}
            break
        crashed = [r.rank for r, (d, x) in zip(ranks, states) if x and not d]
        if crashed:
            if ended_early is None:
                ended_early = now
            elif now - ended_early > 15.0:
                break
        if now - start > timeout:
            timed_out = True
            break
        time.sleep(0.05)
    for r in ranks:
        if r.proc.poll() is None:
            r.killed = True
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)  # the rank's own session only
            except (ProcessLookupError, PermissionError):
                r.proc.kill()
    for r in ranks:
        try:
            r.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(0.2)  # let the reader threads drain the pipes
    # the next run must find the GPUs empty: a killed rank's memory (a whole-GPU hog)
    # is freed by the driver as its process is torn down, not necessarily at once
    idle = None if ctx.fake else wait_gpus_idle(30.0 if any(r.killed for r in ranks) else 10.0)
    out = {"case": case, "tag": tag, "params": params, "port": port,
           "wall_s": time.monotonic() - start, "timeout_s": timeout, "timed_out": timed_out,
           "hang": hang, "gpus_after": idle, "ranks": []}
    ctx.runs.append(out)
    for r in ranks:
        with r.lock:
            events = list(r.events)
        out["ranks"].append({
            "rank": r.rank, "returncode": r.proc.returncode, "killed": r.killed,
            "done": any(e.get("ev") == "done" for e in events), "events": events,
            "stderr_tail": list(r.stderr)[-60:], "stdout_other": list(r.stdout_other)[-20:]})
    return out


def gpu_memory_used() -> Optional[list]:
    """MiB in use per GPU, from nvidia-smi (a read-only query; no CUDA context here)."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15)
        return [int(x.strip()) for x in p.stdout.split() if x.strip().isdigit()] or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def wait_gpus_idle(timeout: float, limit_mib: int = 4096) -> dict:
    """Wait (bounded) until every GPU uses less than ``limit_mib``."""
    start = time.monotonic()
    used = gpu_memory_used()
    while used and max(used) >= limit_mib and time.monotonic() - start < timeout:
        time.sleep(0.5)
        used = gpu_memory_used()
    return {"used_mib": used, "waited_s": time.monotonic() - start,
            "idle": bool(used) and max(used) < limit_mib}


# --------------------------------------------------------------------------- event helpers


def events(run: dict, rank: int, ev: str) -> list:
    return [e for e in run["ranks"][rank]["events"] if e.get("ev") == ev]


def first(run: dict, rank: int, ev: str, **match) -> Optional[dict]:
    for e in events(run, rank, ev):
        if all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def rank_errors(run: dict) -> list:
    out = []
    for r in run["ranks"]:
        for e in r["events"]:
            if e.get("ev") == "error":
                err = e.get("error") or {}
                out.append(f"rank {r['rank']}: {err.get('type')}: {err.get('msg', '')[:300]}")
        if not r["done"] and not r["killed"]:
            tail = " | ".join(r["stderr_tail"][-3:])
            out.append(f"rank {r['rank']}: exited with {r['returncode']} before done: {tail[-300:]}")
    return out


def check(name: str, ok: bool, detail: str = "", required: bool = True) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail, "required": required}


def finish_case(checks: list, data: dict, runs: list, summary: str,
                errors: Optional[list] = None) -> dict:
    """status: fail if a required check failed, else error if a rank reported a harness
    error, else pass."""
    errors = errors or []
    required = [c for c in checks if c.get("required", True)]
    if required and not all(c["ok"] for c in required):
        status = "fail"
    elif errors or not required:
        status = "error"
    else:
        status = "pass"
    return {"status": status, "summary": summary, "checks": checks, "data": data,
            "runs": runs, "errors": errors}


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _outcome_of_call(run: dict, rank: int, label: str) -> dict:
    """What happened to one bracketed call on one rank: returned, raised, or blocked."""
    end = first(run, rank, "call_end", label=label)
    if end is not None:
        if end.get("error"):
            return {"kind": "raised", "seconds": end["seconds"], "type": end["error"]["type"],
                    "msg": end["error"]["msg"][:500], "note": end.get("note")}
        return {"kind": "returned", "seconds": end["seconds"], "note": end.get("note")}
    if first(run, rank, "call_start", label=label) is None:
        return {"kind": "not reached"}
    hang = run.get("hang") or {}
    for h in hang.get("ranks", []):
        if h["rank"] == rank and h["label"] == label:
            return {"kind": "blocked", "blocked_s": h["blocked_s"]}
    if run["ranks"][rank]["killed"]:
        return {"kind": "blocked", "blocked_s": None, "note": "killed at the run's bound"}
    return {"kind": "exited", "returncode": run["ranks"][rank]["returncode"]}


# --------------------------------------------------------------------------- a: positive


def case_a(ctx: Ctx) -> dict:
    params = {"shape": E1, "tokens": [1, 16, 128, 1024, 2048]}
    params.update(ctx.overrides.get("a", {}))
    run = run_pair(ctx, "a", params, timeout=180)
    checks, rows, created = [], [], []
    for r in range(ctx.world_size):
        ev = first(run, r, "created")
        created.append(ev)
        acc = first(run, r, "accuracy")
        for row in (acc or {}).get("rows", []):
            rows.append(dict(row, rank=r))
    ok_created = all(e is not None and e.get("backend") == "trtllm" for e in created)
    checks.append(check("trtllm workspace created on every rank", ok_created,
                        "; ".join(f"rank {r}: {(e or {}).get('result')} "
                                  f"{(e or {}).get('error') or ''}" for r, e in enumerate(created))))
    checks.append(check("vote passed on every rank",
                        all(e is not None and e.get("report", {}).get("vote") == "yes" for e in created)))
    expected_rows = 2 * len(params["tokens"]) * ctx.world_size
    checks.append(check("kAllReduce and kARResidualRMSNorm match the float64 reference",
                        len(rows) == expected_rows and all(row["ok"] for row in rows),
                        f"{sum(1 for row in rows if row['ok'])}/{expected_rows} results within tolerance"))
    snaps = {(e["where"], r): e for r in range(ctx.world_size) for e in events(run, r, "snap")}
    mem = []
    for r in range(ctx.world_size):
        b, a_, rel = (snaps.get(("before_create", r)), snaps.get(("after_create", r)),
                      snaps.get(("after_release", r)))
        mem.append({"rank": r, "free_before": (b or {}).get("free"),
                    "first_creation_cost": (b["free"] - a_["free"]) if b and a_ else None,
                    "after_release_vs_before": (b["free"] - rel["free"]) if b and rel else None})
    data = {"shape": params["shape"], "tokens": params["tokens"],
            "creation": [{"rank": r, "seconds": (e or {}).get("seconds"),
                          "result": (e or {}).get("result"),
                          "report": (e or {}).get("report"),
                          "metadata": (e or {}).get("metadata")} for r, e in enumerate(created)],
            "accuracy": rows, "memory": mem}
    secs = [c["seconds"] for c in data["creation"] if c.get("seconds") is not None]
    summary = (f"created on {sum(1 for e in created if e and e.get('backend') == 'trtllm')}/"
               f"{ctx.world_size} ranks in {max(secs):.2f} s (cold NCCL); "
               f"{sum(1 for row in rows if row['ok'])}/{len(rows)} fused results within tolerance"
               if secs else "no workspace")
    return finish_case(checks, data, [run], summary, rank_errors(run))


# --------------------------------------------------------------------------- b: starved, shim


def case_b(ctx: Ctx) -> dict:
    params = {"shape": E1, "starve_rank": 0, "leave_cold_mb": 256, "leave_warm_mb": 64}
    params.update(ctx.overrides.get("b", {}))
    run = run_pair(ctx, "b", params, timeout=180)
    rows = []
    for r in range(ctx.world_size):
        snaps = {e["where"]: e for e in events(run, r, "snap")}
        for e in events(run, r, "decision"):
            rep = e.get("report") or {}
            snap = snaps.get(f"{e['phase']}_before", {})
            rows.append({"phase": e["phase"], "mode": e["mode"], "rank": r,
                         "outcome": e["outcome"], "seconds": e["seconds"],
                         "probe_ms": rep.get("probe_ms"), "vote_ms": rep.get("vote_ms"),
                         "vote": rep.get("vote"), "free": snap.get("free"),
                         "starved": bool(snap.get("starved")), "nccl_warm": e.get("nccl_warm"),
                         "message": (e.get("veto") or {}).get("message") or rep.get("message"),
                         "error": e.get("error")})
    checks = []
    for phase in ("cold", "warm"):
        for mode, want in (("none", "None"), ("raise", "raised WorkspaceVetoed")):
            got = [row for row in rows if row["phase"] == phase and row["mode"] == mode]
            checks.append(check(
                f"{phase} NCCL, on_veto={mode}: {want} on every rank",
                len(got) == ctx.world_size and all(row["outcome"] == want for row in got),
                "; ".join(f"rank {row['rank']}: {row['outcome']} in {row['seconds'] * 1000:.0f} ms"
                          for row in got)))
    cold = [row for row in rows if row["phase"] == "cold"]
    checks.append(check("NCCL stayed cold through the vetoed calls (no NCCL collective)",
                        bool(cold) and not any(row["nccl_warm"] for row in cold)))
    worst = max((row["seconds"] for row in rows), default=None)
    summary = (f"{sum(1 for c in checks if c['ok'])}/{len(checks)} checks; slowest decision "
               f"{worst * 1000:.0f} ms" if worst is not None else "no decisions recorded")
    return finish_case(checks, {"params": params, "decisions": rows}, [run], summary,
                       rank_errors(run))


# --------------------------------------------------------------------------- c: starved, no shim


def describe_outcome(o: dict, bound: float) -> str:
    kind = o.get("kind")
    if kind == "returned":
        return f"returned ({o.get('note')}) after {o['seconds']:.2f} s"
    if kind == "raised":
        return f"raised {o['type'].rsplit('.', 1)[-1]} after {o['seconds']:.2f} s"
    if kind == "blocked":
        return f"blocked >= {bound:.0f} s (killed)"
    return kind or "?"


def case_c(ctx: Ctx) -> dict:
    runs, rows, checks = [], [], []
    base = {"shape": E1, "starve_rank": 0}
    variants = [("warm", 64), ("cold", 256)]
    for nccl, leave in variants:
        params = dict(base, nccl=nccl, leave_mb=leave, linger=True)
        params.update(ctx.overrides.get("c", {}))
        params["nccl"] = nccl
        run = run_pair(ctx, "c", params, timeout=ctx.hang_bound_s + 120,
                       call_bound=ctx.hang_bound_s, tag=f"c-{nccl}")
        runs.append(run)
        for r in range(ctx.world_size):
            o = _outcome_of_call(run, r, "create")
            snap = first(run, r, "snap", where="before_call") or {}
            rows.append({"nccl": nccl, "rank": r, "starved": bool(snap.get("starved")),
                         "free": snap.get("free"), "outcome": o,
                         "text": describe_outcome(o, ctx.hang_bound_s)})
        state = first(run, 0, "shim_state") or {}
        checks.append(check(f"{nccl}: the shim was not active", state.get("wrapped") is False
                            and state.get("imported") is False,
                            f"imported {state.get('imported')}, wrapped {state.get('wrapped')}, "
                            f"environment {state.get('env')}"))
        got = [row for row in rows if row["nccl"] == nccl]
        checks.append(check(f"{nccl}: outcome recorded on every rank",
                            len(got) == ctx.world_size and all(
                                row["outcome"]["kind"] in ("returned", "raised", "blocked")
                                for row in got),
                            "; ".join(f"rank {row['rank']}: {row['text']}" for row in got)))
    # the reference (section 9) expectation, reported, not required
    cold = [row for row in rows if row["nccl"] == "cold"]
    warm = [row for row in rows if row["nccl"] == "warm"]
    checks.append(check("as in the reference: cold NCCL -> a rank blocked past the bound",
                        any(row["outcome"]["kind"] == "blocked" for row in cold),
                        required=False))
    checks.append(check("as in the reference: warm NCCL -> an exception on every rank",
                        bool(warm) and all(row["outcome"]["kind"] == "raised" for row in warm),
                        required=False))
    summary = "; ".join(f"{row['nccl']} rank {row['rank']}: {row['text']}" for row in rows)
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, {"bound_s": ctx.hang_bound_s, "rows": rows, "base": base,
                                "variants": [{"nccl": n, "leave_mb": m} for n, m in variants]},
                       runs, summary, errors)


# --------------------------------------------------------------------------- d: sweep


def sweep_points(shapes=None, deltas=SWEEP_DELTAS_MB) -> list:
    pts = []
    for name, shape in (shapes or SWEEP_SHAPES):
        for delta in deltas:
            pts.append({"idx": len(pts), "shape_name": name, "shape": shape, "delta_mb": delta})
    return pts


def classify_point(p: dict) -> str:
    """One sweep point's verdict from the shim outcome and, after a veto, FlashInfer's."""
    shim = p.get("shim")
    if shim == "created":
        return "pass, FlashInfer succeeded"
    if shim in ("flashinfer_error", "blocked"):
        return "FALSE PASS: shim let it through, FlashInfer " + (
            "blocked" if shim == "blocked" else "raised")
    if shim == "inconsistent":
        return "INCONSISTENT: ranks decided differently"
    if shim == "vetoed":
        un = p.get("unprotected")
        if un == "created":
            return "false veto: FlashInfer alone succeeded"
        if un == "flashinfer_error":
            return "veto, FlashInfer alone raised"
        if un == "blocked":
            return "veto, FlashInfer alone blocked"
        return "veto (FlashInfer alone not run)"
    return f"no result ({shim})"


def _merge_point(points: dict, run: dict, ctx: Ctx) -> None:
    """Fold one run's events into the per-point records."""
    for r in range(ctx.world_size):
        for e in run["ranks"][r]["events"]:
            idx = e.get("idx")
            if idx is None or idx not in points:
                continue
            p = points[idx]
            per = p.setdefault("ranks", {}).setdefault(r, {})
            if e["ev"] == "point_start":
                per.update(free_before=e["free_before"], starved=e["starved"],
                           leave_target=e.get("leave_target"), hog_left=e.get("hog_left"))
                p.update(plan_peak=e["plan_peak"], plan_cumemcreate=e["plan_cumemcreate"])
                if e.get("need") is not None:
                    p.update(headroom=e["headroom"], need=e["need"])
            elif e["ev"] == "point_shim":
                rep = e.get("report") or {}
                line = rep.get("line") or {}
                per.update(shim=e["outcome"], shim_error=e.get("error"),
                           shim_seconds=e["seconds"], probe_free=rep.get("free_bytes"),
                           probe_ok=rep.get("probe_ok"), vote=rep.get("vote"),
                           message=rep.get("message"), headroom_why=line.get("headroom"),
                           audit=line.get("audit"))
                hb = line.get("headroom_bytes", rep.get("headroom_bytes"))
                pb = line.get("plan_bytes", rep.get("plan_bytes"))
                if p.get("need") is None and isinstance(hb, int) and isinstance(pb, int):
                    p.update(headroom=hb, need=pb + hb, headroom_why=line.get("headroom"))
            elif e["ev"] == "point_unprotected":
                per.update(unprotected=e["outcome"], unprotected_error=e.get("error"),
                           unprotected_free=e.get("free_before"),
                           unprotected_seconds=e["seconds"])
            elif e["ev"] == "point_done":
                per["done"] = True
    hang = run.get("hang") or {}
    for h in hang.get("ranks", []):
        label = h["label"] or ""
        if "#" not in label:
            continue
        kind, idx = label.split("#", 1)
        try:
            idx = int(idx)
        except ValueError:
            continue
        if idx in points:
            per = points[idx].setdefault("ranks", {}).setdefault(h["rank"], {})
            per["shim" if kind == "shim" else "unprotected"] = "blocked"
            per["blocked_s"] = h["blocked_s"]
            points[idx]["hung"] = True


def _summarise_point(p: dict, ctx: Ctx) -> dict:
    ranks = p.get("ranks", {})
    shims = {ranks.get(r, {}).get("shim") for r in range(ctx.world_size)}
    shims.discard(None)
    if "blocked" in shims:
        shim = "blocked"
    elif "flashinfer_error" in shims:
        shim = "flashinfer_error"
    elif len(shims) == 1:
        shim = shims.pop()
    elif not shims:
        shim = None
    else:
        shim = "inconsistent"
    uns = {ranks.get(r, {}).get("unprotected") for r in range(ctx.world_size)}
    uns.discard(None)
    un = "blocked" if "blocked" in uns else ("flashinfer_error" if "flashinfer_error" in uns
                                             else (uns.pop() if len(uns) == 1 else None))
    starved = next((r for r in range(ctx.world_size) if ranks.get(r, {}).get("starved")), None)
    srank = ranks.get(starved, {}) if starved is not None else {}
    free_probe = srank.get("probe_free") or srank.get("free_before")
    need = p.get("need")
    expected = None
    if isinstance(free_probe, int) and isinstance(need, int):
        expected = "pass" if free_probe >= need else "veto"
    out = {k: v for k, v in p.items() if k != "ranks"}
    out.update(shim=shim, unprotected=un, starved_rank=starved,
               free_before=srank.get("free_before"), probe_free=srank.get("probe_free"),
               margin=(free_probe - need) if isinstance(free_probe, int) and isinstance(need, int)
               else None,
               expected=expected, ranks={str(k): v for k, v in ranks.items()})
    per = []
    for r in range(ctx.world_size):
        x = ranks.get(r, {})
        text = x.get("shim") or "not reached"
        if x.get("shim") == "flashinfer_error":
            text = f"raised {(x.get('shim_error') or {}).get('type', '?').rsplit('.', 1)[-1]}"
        elif x.get("shim") == "blocked":
            text = f"blocked {x.get('blocked_s') or 0:.0f} s (killed)"
        per.append(f"r{r} {text}")
    out["per_rank"] = ", ".join(per)
    out["verdict"] = classify_point(out)
    decided = {"created": "pass", "vetoed": "veto", "flashinfer_error": "pass",
               "blocked": "pass"}.get(shim)
    out["as_planned"] = (decided == expected) if decided and expected else None
    return out


def case_d(ctx: Ctx) -> dict:
    cfg = {"headroom_mb": SWEEP_HEADROOM_MB, "starve_rank": 0, "unprotected_after_veto": True}
    cfg.update(ctx.overrides.get("d", {}))
    pts = cfg.pop("points", None) or sweep_points()
    points = {p["idx"]: dict(p) for p in pts}
    runs, attempts = [], 0
    while attempts < 5:
        todo = [p for i, p in sorted(points.items())
                if not any(v.get("done") for v in p.get("ranks", {}).values())
                and not p.get("hung")]
        if not todo or ctx.remaining() < 45:
            break
        params = dict(cfg, points=[{k: p[k] for k in ("idx", "shape", "delta_mb")} for p in todo])
        run = run_pair(ctx, "d", params, timeout=240, call_bound=ctx.sweep_hang_bound_s,
                       tag=f"d-{attempts}")
        runs.append(run)
        attempts += 1
        _merge_point(points, run, ctx)
        if not run.get("hang"):
            break  # finished, or ended for another reason (reported below): no retry
    rows = [_summarise_point(points[i], ctx) for i in sorted(points)]
    checks = []
    run_rows = [r for r in rows if r["shim"] is not None]
    checks.append(check("every point ran", len(run_rows) == len(rows),
                        f"{len(run_rows)}/{len(rows)} points"))
    false_pass = [r for r in rows if r["verdict"].startswith("FALSE PASS")]
    checks.append(check("no false pass: whenever the shim let the call through, FlashInfer "
                        "succeeded", not false_pass and bool(run_rows),
                        "; ".join(f"#{r['idx']} {r['shape_name']} {r['delta_mb']:+d} MiB: "
                                  f"{r['verdict']}" for r in false_pass)))
    inconsistent = [r for r in rows if r["shim"] == "inconsistent"]
    checks.append(check("every rank got the same decision", not inconsistent))
    off_plan = [r for r in rows if r["as_planned"] is False]
    checks.append(check("the decision flips where the plan says (free at the probe vs plan "
                        "peak + headroom)", not off_plan,
                        "; ".join(f"#{r['idx']} margin {r['margin']} B: {r['shim']}"
                                  for r in off_plan), required=False))
    false_veto = [r for r in rows if r["verdict"].startswith("false veto")]
    checks.append(check("no false veto", not false_veto,
                        "; ".join(f"#{r['idx']} {r['shape_name']} {r['delta_mb']:+d} MiB"
                                  for r in false_veto), required=False))
    summary = (f"{len(run_rows)} points: "
               + ", ".join(f"{v} x{n}" for v, n in collections.Counter(
                   r["verdict"] for r in run_rows).items()))
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, {"headroom_mb": cfg["headroom_mb"], "points": rows,
                                "bound_s": ctx.sweep_hang_bound_s, "runs": len(runs)},
                       runs, summary, errors)


# --------------------------------------------------------------------------- e: plan truth


def compare_plan(plan: dict, recorded: list) -> dict:
    """The plan's driver-level allocations next to the recorded ones, in order.

    cuMemCreate entries compare (bytes, handle type, held); a recorded creation counts
    as not held when the same handle was released during the creation (FlashInfer's
    FABRIC attempt) or when it failed."""
    allocs = plan.get("allocations") or []
    planned_create = [[a["bytes"], a.get("handle_type"), bool(a.get("held", True))]
                      for a in allocs if a["api"] == "cuMemCreate"]
    # Handle values can be reused once released: pair each release with the live handle
    # of that value at that moment, in call order.
    actual_create, live = [], {}
    for e in recorded:
        api = e.get("api")
        if api == "cuMemCreate":
            actual_create.append([e["size"], e.get("handle"), bool(e.get("ok"))])
            if e.get("ok"):
                live[e.get("hid")] = len(actual_create) - 1
        elif api == "cuMemImportFromShareableHandle" and e.get("ok"):
            live[e.get("hid")] = None
        elif api == "cuMemRelease" and e.get("ok"):
            index = live.pop(e.get("hid"), None)
            if index is not None:
                actual_create[index][2] = False
    planned_seq = [[a["api"], a["bytes"]] for a in allocs
                   if a["api"] in ("cuMemCreate", "cuMemAlloc", "cudaMalloc")]
    actual_seq = [[e["api"], e["size"]] for e in recorded
                  if e.get("api") in ("cuMemCreate", "cuMemAlloc", "cudaMalloc")]

    def first_diff(a, b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"index": i, "planned": x, "actual": y}
        if len(a) != len(b):
            return {"index": min(len(a), len(b)), "planned_len": len(a), "actual_len": len(b)}
        return None

    held_planned = sum(a["bytes"] for a in allocs if a.get("held", True)
                       and a["api"] == "cuMemCreate")
    held_actual = sum(x[0] for x in actual_create if x[2])
    return {
        "cumemcreate_match": planned_create == actual_create,
        "driver_sequence_match": planned_seq == actual_seq,
        "planned_cumemcreate": planned_create, "actual_cumemcreate": actual_create,
        "planned_sequence": planned_seq, "actual_sequence": actual_seq,
        "cumemcreate_diff": first_diff(planned_create, actual_create),
        "sequence_diff": first_diff(planned_seq, actual_seq),
        "held_cumemcreate_planned": held_planned, "held_cumemcreate_actual": held_actual,
        "plan_peak": plan.get("peak_bytes"),
        "planned_torch_bytes": sum(a["bytes"] for a in allocs if a["api"] == "torch"),
        "imports": sum(1 for e in recorded if e.get("api") == "cuMemImportFromShareableHandle"),
        "maps": sum(1 for e in recorded if e.get("api") == "cuMemMap"),
        "failed_calls": [e for e in recorded if not e.get("ok")
                         and e.get("api") != "cuMemCreate"],
    }


def case_e(ctx: Ctx) -> dict:
    params = {"shapes": PLAN_TRUTH_SHAPES}
    params.update(ctx.overrides.get("e", {}))
    run = run_pair(ctx, "e", params, timeout=240)
    rows = []
    for r in range(ctx.world_size):
        released = {e["name"]: e for e in events(run, r, "plan_truth_release")}
        for e in events(run, r, "plan_truth"):
            cmp_ = compare_plan(e["plan"], e["recorded"]) if "allocations" in e["plan"] else {
                "cumemcreate_match": False, "driver_sequence_match": False,
                "plan_error": e["plan"]}
            rel = released.get(e["name"], {})
            rows.append({"name": e["name"], "entry": e["entry"], "shape": e["shape"], "rank": r,
                         "seconds": e["seconds"], "error": e.get("error"),
                         "metadata": e.get("metadata"), **cmp_,
                         "free_delta": e["free_before"] - e["free_after"],
                         "torch_allocated_delta": e["torch_allocated_delta"],
                         "torch_reserved_delta": e["torch_reserved_delta"],
                         "free_after_release_delta": (e["free_before"] - rel["free_after_release"])
                         if rel else None,
                         "plan_rules": e["plan"].get("rules"),
                         "plan_allocator": e["plan"].get("allocator")})
    n_expected = len(params["shapes"]) * ctx.world_size
    checks = [
        check("every shape created on every rank",
              len(rows) == n_expected and not any(r["error"] for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: {(r['error'] or {}).get('type')}: "
                        f"{(r['error'] or {}).get('msg', '')[:200]}"
                        for r in rows if r["error"])),
        check("cuMemCreate sizes, handle types and FABRIC attempts equal the plan byte for byte",
              len(rows) == n_expected and all(r["cumemcreate_match"] for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: {r.get('cumemcreate_diff')}"
                        for r in rows if not r["cumemcreate_match"])),
        check("cuMemAlloc and cudaMalloc calls equal the plan, in order",
              len(rows) == n_expected and all(r["driver_sequence_match"] for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: {r.get('sequence_diff')}"
                        for r in rows if not r["driver_sequence_match"])),
    ]
    matched = sum(1 for r in rows if r["cumemcreate_match"] and r["driver_sequence_match"])
    summary = f"{matched}/{len(rows)} (shape, rank) recordings equal the plan"
    return finish_case(checks, {"rows": rows}, [run], summary, rank_errors(run))


# --------------------------------------------------------------------------- f: no leak


def case_f(ctx: Ctx) -> dict:
    params = {"shape": E1, "starve_rank": 0, "leave_mb": 64, "cycles": 3}
    params.update(ctx.overrides.get("f", {}))
    run = run_pair(ctx, "f", params, timeout=180)
    per_rank = []
    checks = []
    for r in range(ctx.world_size):
        s = {e["where"]: e for e in events(run, r, "snap")}

        def d(a, b, key="free"):
            if a in s and b in s:
                return s[a][key] - s[b][key]
            return None

        row = {"rank": r,
               "first_cycle_kept": d("start", "first_released"),
               "veto_delta": d("veto_before", "veto_after"),
               "veto_torch_reserved_delta": d("veto_after", "veto_before", "reserved"),
               "veto_held_delta": held_delta((s.get("veto_before") or {}).get("own"),
                                             (s.get("veto_after") or {}).get("own")),
               "cycles": []}
        for i in range(int(params["cycles"])):
            row["cycles"].append({
                "i": i,
                "created_cost": d(f"cycle{i}_before", f"cycle{i}_created"),
                "freed_by_destroy": d(f"cycle{i}_destroy", f"cycle{i}_created"),
                "kept_after_destroy": d(f"cycle{i}_before", f"cycle{i}_destroy"),
                "kept_after_release": d(f"cycle{i}_before", f"cycle{i}_released"),
                "torch_reserved_kept": d(f"cycle{i}_released", f"cycle{i}_before", "reserved"),
            })
        row["empty_cache_gain"] = d("empty_cache", f"cycle{int(params['cycles']) - 1}_released") \
            if params["cycles"] else None
        sticky = first(run, r, "sticky_veto") or {}
        row["after_veto_same_call"] = {"result": sticky.get("result"),
                                       "seconds": sticky.get("seconds"),
                                       "voted": bool((sticky.get("report") or {}).get("vote")),
                                       "error": sticky.get("error")}
        row["snaps"] = {k: {"free": v["free"], "allocated": v.get("allocated"),
                            "reserved": v.get("reserved")} for k, v in s.items()}
        per_rank.append(row)
        held = row["veto_held_delta"]
        if isinstance(held, int):  # what the rank holds: a peer on its device cannot move it
            veto_ok = held == 0
        else:  # no per-process measure: free memory, only for a rank alone on its device
            veto_ok = ctx.ranks_per_device == 1 and row["veto_delta"] == 0
        checks.append(check(f"rank {r}: a vetoed call leaves nothing allocated by the rank",
                            veto_ok, f"held delta {held} B (torch reserved + driver ledger); "
                            f"device free delta {row['veto_delta']} B"))
        last = row["cycles"][-1] if row["cycles"] else {}
        kept = last.get("kept_after_release")
        slack = 2 * MiB * ctx.ranks_per_device  # per process on the device
        checks.append(check(f"rank {r}: create + full release returns the memory (last cycle, "
                            f"within FlashInfer's never-freed cudaMalloc(20): <= {slack // MiB} MiB"
                            + (" for the ranks sharing the GPU)" if ctx.shared_device else ")"),
                            kept is not None and abs(kept) <= slack, f"kept {kept} B"))
        checks.append(check(f"rank {r}: after a veto and with the memory back, the same call "
                            "is probed again (not answered from the veto cache)",
                            row["after_veto_same_call"]["result"] not in (None, "None"),
                            json.dumps(row["after_veto_same_call"], default=str)[:300],
                            required=False))
        destroy_only = [c["kept_after_destroy"] for c in row["cycles"]]
        checks.append(check(f"rank {r}: workspace.destroy() alone (FlashInfer 0.7.4) frees "
                            "the workspace", all(isinstance(k, int) and abs(k) <= slack
                                                 for k in destroy_only) and bool(destroy_only),
                            f"kept after destroy(): {destroy_only}", required=False))
    summary = "; ".join(
        f"rank {row['rank']}: veto held delta {row['veto_held_delta']} B (free "
        f"{row['veto_delta']} B), kept after release "
        f"{[c['kept_after_release'] for c in row['cycles']]} B" for row in per_rank)
    return finish_case(checks, {"params": params, "ranks": per_rank}, [run], summary,
                       rank_errors(run))


# --------------------------------------------------------------------------- g: overhead


def case_g(ctx: Ctx) -> dict:
    params = {"shape": E1, "n": 20, "n_veto": 20, "starve_rank": 0, "leave_mb": 64}
    params.update(ctx.overrides.get("g", {}))
    run = run_pair(ctx, "g", params, timeout=240)
    per_rank, checks = [], []
    for r in range(ctx.world_size):
        rows = (first(run, r, "timings") or {}).get("rows", [])
        vrows = (first(run, r, "veto_timings") or {}).get("rows", [])
        on = [x["seconds"] for x in rows if x["mode"] == "on" and x["seconds"] is not None]
        off = [x["seconds"] for x in rows if x["mode"] == "off" and x["seconds"] is not None]
        pairs = collections.defaultdict(dict)
        for x in rows:
            if x["seconds"] is not None:
                pairs[x["i"]][x["mode"]] = x["seconds"]
        diffs = [v["on"] - v["off"] for v in pairs.values() if "on" in v and "off" in v]
        onr = [x for x in rows if x["mode"] == "on"]
        per_rank.append({
            "rank": r, "n_on": len(on), "n_off": len(off),
            "median_on_s": _median(on), "median_off_s": _median(off),
            "median_paired_diff_s": _median(diffs),
            "min_on_s": min(on) if on else None, "min_off_s": min(off) if off else None,
            "median_probe_ms": _median([x["probe_ms"] for x in onr]),
            "median_vote_ms": _median([x["vote_ms"] for x in onr]),
            "median_decide_ms": _median([x["decide_ms"] for x in onr]),
            "n_veto": len(vrows),
            "veto_all_none": bool(vrows) and all(x["vote"] == "no" and x["error"] is None
                                                 for x in vrows),
            "median_veto_s": _median([x["seconds"] for x in vrows]),
            "max_veto_s": max((x["seconds"] for x in vrows if x["seconds"] is not None),
                              default=None),
            "median_veto_probe_ms": _median([x["probe_ms"] for x in vrows]),
            "median_veto_vote_ms": _median([x["vote_ms"] for x in vrows]),
            "warmup": [e for e in events(run, r, "warmup")],
        })
        checks.append(check(f"rank {r}: >= {params['n']} creations each with the shim on and off",
                            len(on) >= params["n"] and len(off) >= params["n"],
                            f"on {len(on)}, off {len(off)}"))
        checks.append(check(f"rank {r}: every starved call vetoed ({params['n_veto']})",
                            per_rank[-1]["veto_all_none"] and len(vrows) >= params["n_veto"]))
        offr = [x for x in rows if x["mode"] == "off"]
        checks.append(check(f"rank {r}: the 'off' creations made no shim decision (FlashInfer "
                            "alone, legacy binding included)",
                            bool(offr) and all(x.get("vote") is None for x in offr)))
    def ms(v):
        return f"{v * 1000:.1f} ms" if isinstance(v, (int, float)) else "n/a"

    summary = "; ".join(
        f"rank {x['rank']}: on {ms(x['median_on_s'])} vs off {ms(x['median_off_s'])}, "
        f"decide {x['median_decide_ms'] if x['median_decide_ms'] is None else round(x['median_decide_ms'], 1)} ms, "
        f"veto {ms(x['median_veto_s'])}" for x in per_rank)
    return finish_case(checks, {"params": params, "ranks": per_rank}, [run], summary,
                       rank_errors(run))


# --------------------------------------------------------------------------- h: .pth activation


def case_h(ctx: Ctx) -> dict:
    params = {"shape": E1, "starve_rank": 0, "leave_mb": 64}
    params.update(ctx.overrides.get("h", {}))
    run = run_pair(ctx, "h", params, timeout=180, script=PTH_SCRIPT,
                   env_extra={"FLASHINFER_SAFE_WORKSPACE": "1"})
    checks, rows = [], []
    act = [first(run, r, "activation") or {} for r in range(ctx.world_size)]
    src_dir = os.path.join(os.path.dirname(os.path.dirname(HERE)), "flashinfer_safe_workspace")
    for r, a in enumerate(act):
        checks.append(check(f"rank {r}: .pth imported the shim at interpreter start",
                            a.get("fiws_imported_at_start") is True,
                            f"env {a.get('env')}"))
        wrapped = dict(a.get("unified_wrapped") or {}, **(a.get("legacy_wrapped") or {}))
        checks.append(check(f"rank {r}: FlashInfer's creation functions are wrapped",
                            bool(a.get("unified_wrapped")) and all(
                                (a.get("unified_wrapped") or {}).values()) and all(
                                (a.get("legacy_wrapped") or {}).values()),
                            f"{a.get('wrapper_type')}; {wrapped}"))
        fiws_file = a.get("fiws_file") or ""
        checks.append(check(f"rank {r}: the shim came from the installed wheel, not the "
                            "source tree", bool(fiws_file) and not fiws_file.startswith(src_dir),
                            fiws_file, required=not ctx.fake))
        for e in events(run, r, "result"):
            rows.append({"rank": r, "phase": e["phase"], "result": e["result"],
                         "seconds": e["seconds"], "error": e.get("error")})
    room = [x for x in rows if x["phase"] == "room"]
    starved = [x for x in rows if x["phase"] == "starved"]
    checks.append(check("room: a workspace on every rank",
                        len(room) == ctx.world_size and all(
                            x["result"] not in ("None",) and not x["error"] for x in room),
                        "; ".join(f"rank {x['rank']}: {x['result']}" for x in room)))
    checks.append(check("starved rank 0: None on every rank",
                        len(starved) == ctx.world_size and all(
                            x["result"] == "None" and not x["error"] for x in starved),
                        "; ".join(f"rank {x['rank']}: {x['result']} in {x['seconds']:.3f} s"
                                  for x in starved)))
    summary = (f"{sum(1 for c in checks if c['ok'])}/{len(checks)} checks; wrapper "
               f"{act[0].get('wrapper_type')}")
    return finish_case(checks, {"activation": act, "results": rows, "params": params},
                       [run], summary, rank_errors(run))


# --------------------------------------------------------------------------- p: the protocol

# Four shapes (world size 2) used nowhere else in the repository: the audit and tails run
# on shapes the plan was not tuned on.
AUDIT_SHAPES = [
    ("bf16 T3000 H6144", {"T": 3000, "H": 6144, "dtype": "bfloat16"}),
    ("fp16 T700 H3584", {"T": 700, "H": 3584, "dtype": "float16"}),
    ("fp32 T1500 H2560", {"T": 1500, "H": 2560, "dtype": "float32"}),
    ("bf16 T250 H10240", {"T": 250, "H": 10240, "dtype": "bfloat16"}),
]
ENGINE_CALLERS = ("sglang", "vllm")
VETOED = "raised WorkspaceVetoed"


def expected_answer(mode: str, caller: str) -> str:
    """What every rank must get on a veto: ON_VETO=none -> None, raise -> WorkspaceVetoed,
    auto -> WorkspaceVetoed from an engine's module (sglang., vllm.), None otherwise."""
    if mode == "raise":
        return VETOED
    if mode == "auto" and caller in ENGINE_CALLERS:
        return VETOED
    return "None"


def protocol_steps(mode: str) -> list:
    """The calls of one ON_VETO mode's run (fresh shapes vote afresh; a repeated shape is
    answered from the veto cache, which must answer the same way)."""
    (n0, s0), (n1, s1), (n2, s2), (n3, s3) = AUDIT_SHAPES
    room = {"label": f"room, {n0}", "shape": s0, "starve": False, "caller": "plain"}
    if mode == "none":
        return [room,
                {"label": f"starved, {n1}", "shape": s1, "starve": True, "caller": "plain"},
                {"label": f"starved, {n1} again (cached)", "shape": s1, "starve": True,
                 "caller": "plain", "cached": True}]
    if mode == "raise":
        return [{"label": f"starved, {n1}", "shape": s1, "starve": True, "caller": "plain"},
                {"label": f"starved, {n2}, engine caller", "shape": s2, "starve": True,
                 "caller": "sglang"}]
    return [dict(room, caller="sglang", label=f"room, {n0}, engine caller"),
            {"label": f"starved, {n1}", "shape": s1, "starve": True, "caller": "plain"},
            {"label": f"starved, {n2}, sglang caller", "shape": s2, "starve": True,
             "caller": "sglang"},
            {"label": f"starved, {n3}, vllm caller", "shape": s3, "starve": True,
             "caller": "vllm"},
            {"label": f"starved, {n1} again, sglang caller (cached)", "shape": s1,
             "starve": True, "caller": "sglang", "cached": True}]


def _pth_env(ctx: Ctx, extra: Optional[dict] = None) -> dict:
    env = {"FLASHINFER_SAFE_WORKSPACE": "1", "FLASHINFER_SAFE_WORKSPACE_DEBUG": "1"}
    stubs = os.path.join(ctx.workdir(), "callers")
    env["PYTHONPATH"] = stubs + (os.pathsep + os.environ["PYTHONPATH"]
                                 if os.environ.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def _from_tree(path: Optional[str]) -> bool:
    return bool(path) and os.path.abspath(path).startswith(TREE_PACKAGE + os.sep)


def held_delta(before, after) -> Optional[int]:
    """What one rank came to hold across a call, by per-process measures (the rank's
    ``own`` snapshots, ``gpucheck_common.RealDevice.own``): torch's reserved bytes plus the
    bytes it holds through the driver module. None when either snapshot lacks them. Never
    the device's free memory, which on a shared device moves with the peer."""
    def held(own):
        parts = [(own or {}).get("torch_reserved"), (own or {}).get("driver_held")]
        return sum(parts) if all(isinstance(v, int) for v in parts) else None

    a, b = held(before), held(after)
    return None if a is None or b is None else b - a


def _nvml_delta(before, after) -> Optional[int]:
    a, b = (before or {}).get("nvml"), (after or {}).get("nvml")
    return b - a if isinstance(a, int) and isinstance(b, int) else None


def analyse_protocol(mode: str, steps: list, run: dict, ctx: Ctx) -> tuple:
    """(rows, checks) of one ON_VETO mode's run of case p."""
    rows, checks = [], []
    world = ctx.world_size
    act = [first(run, r, "activation") or {} for r in range(world)]
    checks.append(check(f"{mode}: the .pth alone activated the shim (FLASHINFER_SAFE_WORKSPACE=1, "
                        "no import in the script), from the installed wheel",
                        all(a.get("fiws_imported_at_start") is True and a.get("unified_wrapped")
                            and (ctx.fake or not _from_tree(a.get("fiws_file"))) for a in act),
                        "; ".join(f"rank {r}: at start {a.get('fiws_imported_at_start')}, wrapped "
                                  f"{a.get('unified_wrapped')}, {a.get('fiws_file')}"
                                  for r, a in enumerate(act))))
    for i, step in enumerate(steps):
        got = [first(run, r, "step", i=i) for r in range(world)]
        want = expected_answer(mode, step["caller"]) if step["starve"] else "created"
        per = []
        for r, e in enumerate(got):
            e = e or {}
            line = (e.get("decisions") or [{}])[-1]
            per.append({"mode": mode, "step": i, "label": step["label"], "caller": step["caller"],
                        "starve": step["starve"], "cached": bool(step.get("cached")), "rank": r,
                        "starved": e.get("starved"), "outcome": e.get("outcome"), "expected": want,
                        "seconds": e.get("seconds"), "wall_start": e.get("wall_start"),
                        "wall_end": e.get("wall_end"),
                        "free_delta": (e["free_before"] - e["free_after"])
                        if isinstance(e.get("free_before"), int) and isinstance(e.get("free_after"), int)
                        else None,
                        "reserved_delta": (e["reserved_after"] - e["reserved_before"])
                        if isinstance(e.get("reserved_before"), int) else None,
                        "held_delta": held_delta(e.get("own_before"), e.get("own_after")),
                        "nvml_delta": _nvml_delta(e.get("own_before"), e.get("own_after")),
                        "free_before": e.get("free_before"), "hog_left": e.get("hog_left"),
                        "line": line, "n_lines": len(e.get("decisions") or []),
                        "error": e.get("error"), "warnings": e.get("warnings")})
        rows += per
        ok = all(x["outcome"] == want for x in per)
        checks.append(check(f"{mode} #{i} {step['label']} ({step['caller']} caller): {want} on "
                            "every rank", ok,
                            "; ".join(f"rank {x['rank']}: {x['outcome']}"
                                      + (f" ({(x['error'] or {}).get('msg', '')[:160]})"
                                         if x["error"] and x["outcome"] != VETOED else "")
                                      for x in per)))
        if step["starve"]:
            checks.append(_left_nothing(f"{mode} #{i}", per, ctx))
            starts = [x["wall_start"] for x in per]
            ends = [x["wall_end"] for x in per]
            if all(isinstance(t, float) for t in starts + ends):
                lag = max(ends) - max(starts)
                for x in per:
                    x["after_slowest_arrival_s"] = x["wall_end"] - max(starts)
                checks.append(check(f"{mode} #{i}: every rank answered within 50 ms of the "
                                    "slower rank's arrival", lag <= 0.050,
                                    f"{lag * 1000:.1f} ms"))
        if not step.get("cached"):
            lines = [x["line"] for x in per]
            want_outcome = "veto" if step["starve"] else "pass"
            checks.append(check(f"{mode} #{i}: a decision line outcome={want_outcome} on every rank",
                                all(str(line.get("outcome")) == want_outcome for line in lines),
                                "; ".join(f"rank {x['rank']}: outcome={x['line'].get('outcome')} "
                                          f"answer={x['line'].get('answer')} "
                                          f"headroom={x['line'].get('headroom')} "
                                          f"caller={x['line'].get('caller')}" for x in per)))
            if step["starve"] and any("answer" in line for line in lines):
                want_answer = "raise" if want == VETOED else "none"
                checks.append(check(f"{mode} #{i}: answer={want_answer} on the decision line",
                                    all(line.get("answer") == want_answer for line in lines),
                                    "; ".join(str(line.get("answer")) for line in lines)))
    return rows, checks


def _left_nothing(label: str, per: list, ctx: Ctx) -> dict:
    """The check that a vetoed call left nothing allocated, on every rank, measured per rank
    (``held_delta``). The device's free-memory delta is shown beside it, and judged only by
    a rank alone on its device and only when the rank reported no per-process measure."""
    held = [x.get("held_delta") for x in per]
    free = [x.get("free_delta") for x in per]
    nvml = [x.get("nvml_delta") for x in per]
    detail = (f"held deltas {held} B (torch reserved + driver ledger, per rank); NVML "
              f"per-process deltas {nvml} B; device free deltas {free} B"
              + (f" ({ctx.ranks_per_device} ranks share the device: the peer's moves too)"
                 if ctx.ranks_per_device > 1 else ""))
    if all(isinstance(d, int) for d in held):
        ok = all(d == 0 for d in held)
    elif ctx.ranks_per_device == 1:  # alone on its device: free memory is its own
        ok = all(d == 0 for d in free)
    else:
        ok, detail = False, "no per-process measure reported; " + detail
    return check(f"{label}: the vetoed call left 0 bytes allocated by each rank (what the rank "
                 "holds, before vs after)", ok, detail)


def case_p(ctx: Ctx) -> dict:
    cfg = {"modes": ["none", "raise", "auto"], "starve_rank": 0, "leave_mb": 16}
    cfg.update(ctx.overrides.get("p", {}))
    runs, rows, checks = [], [], []
    for mode in cfg["modes"]:
        steps = protocol_steps(mode)
        params = {"steps": steps, "starve_rank": cfg["starve_rank"], "leave_mb": cfg["leave_mb"]}
        run = run_pair(ctx, "p", params, timeout=150, script=PTH_SCRIPT, tag=f"p-{mode}",
                       call_bound=30.0,
                       env_extra=_pth_env(ctx, {"FLASHINFER_SAFE_WORKSPACE_ON_VETO": mode}))
        runs.append(run)
        r_rows, r_checks = analyse_protocol(mode, steps, run, ctx)
        rows += r_rows
        checks += r_checks
        if run.get("hang") or run.get("timed_out"):
            checks.append(check(f"{mode}: no process hung", False, json.dumps(run.get("hang"))))
    bad = [c for c in checks if not c["ok"]]
    summary = (f"{len(checks) - len(bad)}/{len(checks)} checks over modes {','.join(cfg['modes'])}"
               + (f"; first failure: {bad[0]['name']}" if bad else ""))
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, {"params": cfg, "rows": rows,
                                "shared_device": ctx.shared_device}, runs, summary, errors)


# --------------------------------------------------------------------------- q: audit and tails


def analyse_tails(rows: list, ctx: Ctx) -> dict:
    """Per shape: what a creation took beyond the plan, for the process's first creation
    and for later ones. On a shared device the free-memory delta holds every rank's
    allocations; it is divided by the ranks on the device first."""
    out: dict = {}
    for row in rows:
        plan = row.get("plan_bytes")
        delta = row.get("free_delta")
        if not isinstance(plan, int) or plan < 0 or not isinstance(delta, int):
            continue
        row["tail"] = delta // ctx.ranks_per_device - plan
        rec = out.setdefault(row["name"], {"first": [], "later": [], "plan_bytes": plan})
        rec["first" if row["first"] else "later"].append(row["tail"])
    for rec in out.values():
        rec["first_max"] = max(rec["first"]) if rec["first"] else None
        rec["later_max"] = max(rec["later"]) if rec["later"] else None
        rec["later_median"] = _median(rec["later"])
    return out


def case_q(ctx: Ctx) -> dict:
    cfg = {"shapes": [{"name": n, "shape": sh} for n, sh in AUDIT_SHAPES]}
    cfg.update(ctx.overrides.get("q", {}))
    shapes = cfg["shapes"]
    runs, rows = [], []
    for k, head in enumerate(shapes):
        creations = [head] + shapes  # first creation of the process, then every shape later
        run = run_pair(ctx, "q", {"creations": creations}, timeout=150, script=PTH_SCRIPT,
                       tag=f"q-{k}", call_bound=60.0, env_extra=_pth_env(ctx))
        runs.append(run)
        for r in range(ctx.world_size):
            for e in events(run, r, "creation"):
                line = (e.get("decisions") or [{}])[-1]
                rows.append({"run": k, "rank": r, "i": e["i"], "name": e["name"],
                             "first": e["first"], "outcome": e["outcome"],
                             "seconds": e["seconds"], "error": e.get("error"),
                             "audit": line.get("audit"), "plan_bytes": line.get("plan_bytes"),
                             "headroom": line.get("headroom"),
                             "headroom_bytes": line.get("headroom_bytes"),
                             "free_before": e["free_before"],
                             "free_delta": e["free_before"] - e["free_after"],
                             "kept_after_release": (e["free_before"] - e["free_released"])
                             if isinstance(e.get("free_released"), int) else None,
                             "reserved_delta": e["reserved_after"] - e["reserved_before"],
                             "line": line, "warnings": e.get("warnings")})
        if ctx.remaining() < 40:
            break
    tails = analyse_tails(rows, ctx)
    n_expected = len(runs) * (len(shapes) + 1) * ctx.world_size
    checks = [
        check("every creation returned a workspace on every rank",
              len(rows) == n_expected and all(r["outcome"] == "created" for r in rows),
              f"{sum(1 for r in rows if r['outcome'] == 'created')}/{n_expected}; "
              + "; ".join(f"{r['name']} rank {r['rank']}: {r['outcome']}"
                          for r in rows if r["outcome"] != "created")[:600]),
        check("audit=ok on the decision line of every creation (FlashInfer's real calls vs the plan)",
              bool(rows) and all(r["audit"] == "ok" for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']} (run {r['run']}): audit={r['audit']}"
                        for r in rows if r["audit"] != "ok")[:800] +
              ("; " + " | ".join(w for r in rows for w in (r["warnings"] or []))[:600]
               if any(r["warnings"] for r in rows) else "")),
        check("every shape has a first-creation and a later tail",
              len(tails) >= len(shapes) and all(t["first"] and t["later"] for t in tails.values()),
              f"{len(tails)} shapes with tails"),
    ]
    firsts = [t["first_max"] for t in tails.values() if t["first_max"] is not None]
    laters = [t["later_max"] for t in tails.values() if t["later_max"] is not None]
    worst = max(firsts + laters) if firsts + laters else None
    data = {"rows": rows, "tails": tails, "shared_device": ctx.shared_device,
            # the smallest reserve that covers every tail seen, on the 2 MiB grid
            "reserve_covering_tails_mb": (-(-worst // (2 * MiB)) * 2 if worst and worst > 0
                                          else 0) if worst is not None else None,
            "ranks_per_device": ctx.ranks_per_device,
            "max_first_tail": max(firsts) if firsts else None,
            "max_later_tail": max(laters) if laters else None}
    summary = (f"{sum(1 for r in rows if r['audit'] == 'ok')}/{len(rows)} creations audit=ok; "
               f"tail beyond the plan: first creation <= "
               f"{(data['max_first_tail'] or 0) / MiB:.1f} MiB, later <= "
               f"{(data['max_later_tail'] or 0) / MiB:.1f} MiB per rank")
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, data, runs, summary, errors)


# --------------------------------------------------------------------------- k: cold NCCL boundary

# A 1-rank NCCL communicator's start-up took 650 MiB on the H200 (audit branch, 433e46e):
# the coarse points reach past 512 MiB.
COLD_COARSE_MB = (128, 512, 768, 1024)
COLD_FINE_STEPS = 2


def cold_outcome(run: dict, ctx: Ctx) -> dict:
    """One cold point: created on both, raised on both, raised on one (and the other?),
    or hung; with each rank's outcome."""
    per = [_outcome_of_call(run, r, "create") for r in range(ctx.world_size)]
    kinds = [o.get("kind") for o in per]
    if any(k == "blocked" for k in kinds):
        verdict = "hung"
    elif all(k == "returned" for k in kinds):
        verdict = "created"
    elif all(k == "raised" for k in kinds):
        verdict = "raised"
    else:
        verdict = "mixed: " + ",".join(str(k) for k in kinds)
    return {"verdict": verdict, "ranks": per,
            "text": "; ".join(f"rank {r}: {describe_outcome(o, ctx.cold_hang_bound_s)}"
                              for r, o in enumerate(per))}


def bracket(points: dict):
    """(largest X that did not create, smallest X that created) over the points so far."""
    ok = sorted(x for x, p in points.items() if p["verdict"] == "created")
    bad = sorted(x for x, p in points.items() if p["verdict"] != "created")
    hi = ok[0] if ok else None
    lo = max((x for x in bad if hi is None or x < hi), default=None)
    return lo, hi


def case_k(ctx: Ctx) -> dict:
    cfg = {"shape": E1, "starve_rank": 0, "coarse_mb": list(COLD_COARSE_MB),
           "fine_steps": COLD_FINE_STEPS, "resolution_mb": 4}
    cfg.update(ctx.overrides.get("k", {}))
    points, runs = {}, []

    def run_point(x: int) -> None:
        params = {"shape": cfg["shape"], "starve_rank": cfg["starve_rank"], "above_plan_mb": x,
                  "linger": True}
        run = run_pair(ctx, "k", params, timeout=ctx.cold_hang_bound_s + 90,
                       call_bound=ctx.cold_hang_bound_s, tag=f"k-{x}")
        runs.append(run)
        pt = cold_outcome(run, ctx)
        st = first(run, cfg["starve_rank"], "cold_point") or {}
        state = first(run, 0, "shim_state") or {}
        pt.update(above_plan_mb=x, plan_peak=st.get("plan_peak"), free_before=st.get("free_before"),
                  nccl_warm=st.get("nccl_warm"), shim_wrapped=state.get("wrapped"))
        points[x] = pt

    for x in cfg["coarse_mb"]:
        if ctx.remaining() < ctx.cold_hang_bound_s + 30:
            break
        run_point(int(x))
    for _ in range(int(cfg["fine_steps"])):
        lo, hi = bracket(points)
        if lo is None or hi is None or hi - lo <= cfg["resolution_mb"]:
            break
        if ctx.remaining() < ctx.cold_hang_bound_s + 30:
            break
        mid = (lo + hi) // 2
        mid -= mid % 2
        if mid in points or mid <= lo:
            break
        run_point(mid)
    lo, hi = bracket(points)
    rows = [points[x] for x in sorted(points)]
    ctx.shared["cold_need"] = {"lo_mb": lo, "hi_mb": hi, "shape": cfg["shape"]}
    hung = [r for r in rows if r["verdict"] == "hung"]
    checks = [
        check("every point's outcome recorded within the bound on every rank",
              bool(rows) and all(all(o.get("kind") in ("returned", "raised", "blocked")
                                     for o in r["ranks"]) for r in rows),
              "; ".join(f"+{r['above_plan_mb']} MiB: {r['text']}" for r in rows)[:900]),
        check("NCCL was cold at every point (no collective before FlashInfer's)",
              bool(rows) and not any(r.get("nccl_warm") for r in rows)),
        check("the shim was not active at any point (FlashInfer alone)",
              bool(rows) and all(r.get("shim_wrapped") is False for r in rows)),
        check("the cold need is bracketed (a point that failed below one that created)",
              lo is not None and hi is not None, f"lo {lo}, hi {hi}", required=False),
    ]
    summary = (f"FlashInfer alone with cold NCCL needs more than plan + {lo} MiB and at most "
               f"plan + {hi} MiB free on the starved rank" if lo is not None and hi is not None
               else f"not bracketed: lo {lo}, hi {hi}") + \
        f"; {len(hung)} of {len(rows)} points hung (killed at {ctx.cold_hang_bound_s:.0f} s)"
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, {"params": cfg, "points": rows, "lo_mb": lo, "hi_mb": hi,
                                "bound_s": ctx.cold_hang_bound_s}, runs, summary, errors)


# --------------------------------------------------------------------------- l: shim across it


def boundary_points(variant: str, ctx: Ctx) -> list:
    """MiB above the plan to leave on the starved rank, per variant: for cold NCCL around
    FlashInfer's cold need (case k, when it ran) and around the NCCL reserve; for warm NCCL
    and a gloo group around the small reserve."""
    if variant == "nccl-cold":
        need = ctx.shared.get("cold_need") or {}
        pts = {need.get("lo_mb") or 128, need.get("hi_mb") or 256, 508, 516}
    else:
        pts = {2, 8, 32, 60, 68, 128}
    return sorted(int(x) for x in pts if x is not None)


def margins(rows: list) -> dict:
    """The smallest leftover (MiB above the plan) at which the shim passed, at which
    FlashInfer succeeded (alone after a veto, or after the shim's yes), and the false-veto
    margin between them."""
    shim_pass = [r["above_plan_mb"] for r in rows if r["shim"] == "created"]
    fi_ok = [r["above_plan_mb"] for r in rows
             if r["shim"] == "created" or r.get("unprotected") == "created"]
    out = {"shim_pass_min_mb": min(shim_pass) if shim_pass else None,
           "flashinfer_ok_min_mb": min(fi_ok) if fi_ok else None}
    if out["shim_pass_min_mb"] is not None and out["flashinfer_ok_min_mb"] is not None:
        out["false_veto_margin_mb"] = out["shim_pass_min_mb"] - out["flashinfer_ok_min_mb"]
    elif out["flashinfer_ok_min_mb"] is not None:  # the shim never said yes: a lower bound
        out["false_veto_margin_at_least_mb"] = (max(r["above_plan_mb"] for r in rows)
                                                - out["flashinfer_ok_min_mb"])
    vetoed_ok = [r["above_plan_mb"] for r in rows if r["verdict"].startswith("false veto")]
    out["largest_false_veto_mb"] = max(vetoed_ok) if vetoed_ok else None
    return out


def case_l(ctx: Ctx) -> dict:
    cfg = {"shape": E1, "starve_rank": 0, "variants": ["nccl-cold", "nccl-warm", "gloo"]}
    cfg.update(ctx.overrides.get("l", {}))
    runs, rows, by_variant = [], [], {}
    for variant in cfg["variants"]:
        xs = cfg.get(f"points_{variant}") or boundary_points(variant, ctx)
        pts = {i: {"idx": i, "shape_name": "E1", "shape": cfg["shape"], "above_plan_mb": x,
                   "delta_mb": 0} for i, x in enumerate(xs)}
        base = {"headroom_mb": None, "starve_rank": cfg["starve_rank"],
                "unprotected_after_veto": True, "linger": True,
                "nccl": "cold" if variant == "nccl-cold" else "warm",
                "group": "gloo" if variant == "gloo" else "world"}
        attempts = 0
        while attempts < len(xs) + 2 and ctx.remaining() > ctx.cold_hang_bound_s + 30:
            todo = [p for i, p in sorted(pts.items())
                    if not any(v.get("done") for v in p.get("ranks", {}).values())
                    and not p.get("hung")]
            if not todo:
                break
            batch = todo[:1] if variant == "nccl-cold" else todo  # cold: fresh processes
            params = dict(base, points=[{k: p[k] for k in ("idx", "shape", "delta_mb",
                                                           "above_plan_mb")} for p in batch])
            run = run_pair(ctx, "d", params, timeout=240, call_bound=ctx.cold_hang_bound_s,
                           tag=f"l-{variant}-{attempts}")
            runs.append(run)
            attempts += 1
            _merge_point(pts, run, ctx)
            if variant != "nccl-cold" and not run.get("hang"):
                break
        v_rows = []
        for i in sorted(pts):
            row = _summarise_point(pts[i], ctx)
            row["variant"] = variant
            row["headroom_why"] = pts[i].get("headroom_why")
            v_rows.append(row)
        rows += v_rows
        by_variant[variant] = margins([r for r in v_rows if r["shim"] is not None])
        by_variant[variant]["headroom"] = next((r.get("headroom") for r in v_rows
                                                if r.get("headroom") is not None), None)
        by_variant[variant]["headroom_why"] = next((r.get("headroom_why") for r in v_rows
                                                    if r.get("headroom_why")), None)
    ran = [r for r in rows if r["shim"] is not None]
    false_pass = [r for r in ran if r["verdict"].startswith("FALSE PASS")]
    checks = [
        check("every point ran", len(ran) == len(rows), f"{len(ran)}/{len(rows)} points"),
        check("no false pass: wherever the shim said yes, FlashInfer created the workspace",
              bool(ran) and not false_pass,
              "; ".join(f"{r['variant']} +{r['above_plan_mb']} MiB: {r['verdict']}"
                        for r in false_pass)),
        check("every rank got the same decision", not any(r["shim"] == "inconsistent" for r in ran)),
    ]
    for variant, m in by_variant.items():
        checks.append(check(f"{variant}: false-veto margin (shim's first yes minus FlashInfer's "
                            "first success, MiB above the plan)",
                            m.get("false_veto_margin_mb") is not None
                            or m.get("false_veto_margin_at_least_mb") is not None,
                            json.dumps(m), required=False))
    summary = "; ".join(f"{v}: headroom {m.get('headroom_why')} "
                        f"{(m.get('headroom') or 0) / MiB:.0f} MiB, false-veto margin "
                        f"{m.get('false_veto_margin_mb')} MiB" for v, m in by_variant.items())
    if false_pass:
        summary = f"{len(false_pass)} FALSE PASS; " + summary
    errors = [e for run in runs for e in rank_errors(run)]
    return finish_case(checks, {"params": cfg, "points": rows, "margins": by_variant,
                                "bound_s": ctx.cold_hang_bound_s}, runs, summary, errors)


# --------------------------------------------------------------------------- n: allocator C

ALLOCATOR_C_SHAPES = [
    {"name": "legacy default path, bf16 T34 H5120", "entry": "legacy-c",
     "shape": {"T": 34, "H": 5120, "dtype": "bfloat16"}},
    {"name": "legacy default path, fp32 T91 H2880", "entry": "legacy-c",
     "shape": {"T": 91, "H": 2880, "dtype": "float32"}},
]


def case_n(ctx: Ctx) -> dict:
    """Allocator C (torch symmetric memory; FlashInfer 0.7.4's legacy default path): the
    plan's per-buffer bytes against what each buffer really took (free-memory delta
    around FlashInfer's own ``_alloc_symm_buffer_bytes``), and the whole creation's
    free-memory delta against the plan peak."""
    params = {"shapes": ALLOCATOR_C_SHAPES}
    params.update(ctx.overrides.get("n", {}))
    run = run_pair(ctx, "n", params, timeout=180)
    rows = []
    for r in range(ctx.world_size):
        for e in events(run, r, "alloc_c"):
            plan = e.get("plan") or {}
            peak = plan.get("peak_bytes")
            planned = [a.get("bytes") for a in plan.get("allocations") or []
                       if a.get("api") == "cuMemCreate" and a.get("held", True)]
            measured = [b["free_delta"] for b in e.get("buffers") or []]
            used = e["free_before"] - e["free_after"]
            rows.append({"name": e["name"], "rank": r, "error": e.get("error"),
                         "signal_pad": e.get("signal_pad"), "plan_peak": peak,
                         "plan_allocator": plan.get("allocator"), "planned_buffers": planned,
                         "measured_buffers": measured,
                         "buffers_match": bool(planned) and planned == measured,
                         "free_delta": used,
                         "used_minus_plan": used - peak if isinstance(peak, int) else None,
                         "kept_after_release": e["free_before"] - e["free_released"],
                         "torch_reserved_delta": e["torch_reserved_delta"],
                         "seconds": e["seconds"], "plan_error": plan.get("error")})
    n_expected = len(params["shapes"]) * ctx.world_size
    checks = [
        check("every shape created on every rank",
              len(rows) == n_expected and not any(r["error"] for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: {(r['error'] or {}).get('msg', '')[:200]}"
                        for r in rows if r["error"])),
        check("each torch symmetric-memory buffer took exactly the plan's bytes (signal pad "
              "and rounding)", len(rows) == n_expected and all(r["buffers_match"] for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: planned {_mib_list(r['planned_buffers'])}"
                        f" MiB, took {_mib_list(r['measured_buffers'])} MiB (pad {r['signal_pad']})"
                        for r in rows if not r["buffers_match"])),
        check("the whole creation took no more than the plan peak + 4 MiB (small pages)",
              len(rows) == n_expected and all(isinstance(r["used_minus_plan"], int)
                                              and r["used_minus_plan"] <= 4 * MiB for r in rows),
              "; ".join(f"{r['name']} rank {r['rank']}: used - plan = "
                        f"{(r['used_minus_plan'] or 0) / MiB:+.2f} MiB" for r in rows),
              required=False),
    ]
    summary = "; ".join(f"{r['name']} r{r['rank']}: buffers planned "
                        f"{_mib_list(r['planned_buffers'])} took {_mib_list(r['measured_buffers'])} MiB"
                        for r in rows) or "no rows"
    return finish_case(checks, {"rows": rows}, [run], summary, rank_errors(run))


def _mib_list(values) -> str:
    return "+".join(f"{v / MiB:g}" for v in values or [] if isinstance(v, (int, float)))


def case_w(ctx: Ctx) -> dict:
    """The one-GPU hang with FlashInfer 0.7.2.post1, with and without the shim (its own
    module: ``gpucheck_hang``)."""
    import gpucheck_hang

    return gpucheck_hang.case_w(ctx)


# --------------------------------------------------------------------------- registry

# (key, title, function, minimum seconds it needs to be worth starting), in run order:
# the sweep goes last because each hang it finds costs its bound plus a restart.
CASES = [
    ("p", "Protocol through the .pth: pass, and a veto with ON_VETO none / raise / auto", case_p, 45),
    ("q", "Audit of real creations and the tails beyond the plan (four new shapes)", case_q, 45),
    ("a", "Positive: real workspace, correct fused all-reduce", case_a, 40),
    ("h", "Activation through the installed .pth", case_h, 40),
    ("b", "Starved rank, shim on: None / WorkspaceVetoed on every rank", case_b, 40),
    ("c", "Starved rank, no shim: FlashInfer 0.7.4 alone (before)", case_c, 100),
    ("e", "Plan truth: recorded allocations vs the plan", case_e, 50),
    ("f", "No leak: free memory around veto and create/destroy", case_f, 40),
    ("g", "Overhead: shim on vs off, probe + vote, veto latency", case_g, 50),
    ("d", "Boundary sweep around plan peak + headroom", case_d, 60),
    ("k", "Cold-NCCL boundary, FlashInfer alone: its true need above the plan", case_k, 60),
    ("l", "The shim at its default headroom across the cold/warm NCCL and gloo boundary", case_l, 60),
    ("n", "Allocator C (torch symmetric memory) plan truth", case_n, 40),
    ("w", "The hang on one GPU, FlashInfer 0.7.2.post1: the peer inside the creation, then "
          "the starved rank; without and with the shim", case_w, 100),
]
# Cases that reach no FlashInfer kernel: a run of only these needs no trtllm_comm module
# (gpu-check then skips its preflight, which would JIT-build it for a release without a
# prebuilt cache).
NO_KERNEL_CASES = {"w"}
CASE_TITLES = {key: title for key, title, _, _ in CASES}

# Which cases each device kind runs, in order. One GPU: two ranks share cuda:0 over a
# gloo WORLD (no NCCL, no torch symmetric memory: they refuse two ranks on one GPU), so
# the fused all-reduce (a), NCCL starvation (b, c), the boundary (d, k, l) and
# allocator C (n) wait for two GPUs.
PROFILES = {
    "one": ["p", "q", "h", "e", "f", "g"],
    # issue 12's new cases first; c and d (each costs a hang bound) last: the budget skips
    # what does not fit in one device call
    "two": ["p", "k", "l", "n", "a", "h", "b", "e", "f", "g", "c", "d"],
}
PROFILE_NAMES = {"one": "one-GPU (nvidia-h200: two ranks share cuda:0, gloo WORLD)",
                 "two": "two-GPU (nvidia-h200-x2: rank r on cuda:r, NCCL WORLD)"}


def run_case(key: str, ctx: Ctx) -> dict:
    """Run one case; a harness exception becomes status 'error' (never raises)."""
    fn = {k: f for k, _, f, _ in CASES}[key]
    start = time.monotonic()
    ctx.runs = []
    try:
        result = fn(ctx)
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the others
        import traceback

        result = {"status": "error", "summary": f"harness error: {type(exc).__name__}: {exc}",
                  "checks": [], "data": {}, "runs": list(ctx.runs),
                  "errors": [traceback.format_exc()[-3000:]]}
    result["wall_s"] = time.monotonic() - start
    result["title"] = CASE_TITLES[key]
    return result
