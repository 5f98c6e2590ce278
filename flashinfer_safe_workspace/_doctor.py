"""``doctor`` (is the shim active here, and why) and ``check`` (does a workspace fit
on this GPU now): the two read-only commands an operator runs before a launch.

Neither changes anything: ``doctor`` may import ``flashinfer.comm`` to see what the
hooks wrapped, ``check`` creates and releases the plan's allocations exactly as the
wrapper's probe does (never a multicast object) and talks to no other rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import site
import sys
import time
from typing import Optional

MiB = 1 << 20
PTH_NAME = "flashinfer_safe_workspace.pth"

# check's exit codes (a launch script or CI gate reads these)
FITS = 0
DOES_NOT_FIT = 1
CANNOT_TELL = 2


# --------------------------------------------------------------------------- doctor


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def _site_dirs() -> list:
    """Directories whose ``.pth`` files Python runs at start-up."""
    dirs: list = []
    try:
        dirs += list(site.getsitepackages())
    except Exception:  # some embedded interpreters lack it
        pass
    try:
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
    except Exception:
        pass
    return dirs


def find_pth_files() -> list:
    """``(path, runs_at_start)`` for every ``flashinfer_safe_workspace.pth`` in a site
    directory (``.pth`` files there run at start-up) or elsewhere on ``sys.path``
    (found, but Python does not run ``.pth`` files from plain path entries)."""
    seen, found = set(), []
    site_dirs = _site_dirs()
    for runs, dirs in ((True, site_dirs), (False, [p for p in sys.path if p])):
        for d in dirs:
            real = os.path.realpath(d)
            if real in seen:
                continue
            seen.add(real)
            path = os.path.join(d, PTH_NAME)
            if os.path.isfile(path):
                found.append((path, runs))
    return found


def _pth_report() -> dict:
    entries = []
    for path, runs in find_pth_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            entries.append({"path": path, "runs_at_start": runs, "ok": False,
                            "problem": f"unreadable: {exc}"})
            continue
        ok = "FLASHINFER_SAFE_WORKSPACE" in text and "flashinfer_safe_workspace" in text
        entries.append({"path": path, "runs_at_start": runs, "ok": ok,
                        "problem": "" if ok else "does not contain the activation line"})
    return {
        "files": entries,
        "site_dirs": _site_dirs(),
        "site_enabled": not sys.flags.no_site,  # -S: no .pth file runs at all
    }


def _flashinfer_report(import_comm: bool) -> dict:
    from . import _patch, _releases
    from ._plan import Unplanned

    version = _dist_version("flashinfer-python")
    out: dict = {"version": version, "rules": None, "verified": False, "newest_mirrored":
                 ".".join(map(str, _releases.NEWEST[:3])), "imported": False,
                 "import_error": None, "wrapped": []}
    if version is None:
        out["note"] = "flashinfer-python is not installed"
        return out
    try:
        out["rules"] = _releases.range_of(version)
        out["verified"] = not _releases.is_unknown(version)
        if not out["verified"]:
            out["note"] = (f"newer than the newest release whose rules were read "
                           f"({out['newest_mirrored']}): FLASHINFER_SAFE_WORKSPACE_UNKNOWN_VERSION "
                           "decides")
    except Unplanned as exc:
        out["note"] = str(exc)
    if import_comm:
        try:
            import flashinfer.comm  # noqa: F401 - fires the post-import hooks

            out["imported"] = True
        except Exception as exc:  # a broken install: report, do not crash
            out["import_error"] = f"{type(exc).__name__}: {exc}"
    out["wrapped"] = _patch.wrapped_bindings()
    return out


def _cuda_report() -> dict:
    """Driver version and device count through cuda-python; never raises."""
    out: dict = {"bindings": None, "driver_version": None, "device_count": None, "error": None}
    try:
        from . import _probe

        drv = _probe._driver()
        out["bindings"] = drv.__name__
    except Exception as exc:
        out["error"] = f"no cuda-python driver bindings: {exc}"
        return out
    try:
        from ._probe import _check

        _check(drv.cuInit(0))
        version = int(_check(drv.cuDriverGetVersion()))
        out["driver_version"] = f"{version // 1000}.{(version % 1000) // 10}"
        out["device_count"] = int(_check(drv.cuDeviceGetCount()))
    except Exception as exc:
        name = getattr(exc, "name", "") or type(exc).__name__
        out["error"] = f"no driver: {name}: {exc}" if str(exc) != name else f"no driver: {name}"
    return out


def _watching() -> bool:
    """The bootstrap's lazy watcher is on ``sys.meta_path``: the hooks get registered
    (and wrapt imported) at the first ``import flashinfer``."""
    from . import _bootstrap

    return _bootstrap.watching()


def doctor_report(import_flashinfer: bool = True) -> dict:
    """Everything ``doctor`` prints, as one JSON-able dict."""
    from . import _bootstrap, _config, _patch
    from ._version import __version__

    settings = _config.current()
    raw = _config.env_value(_config.PREFIX)
    wrapt_version = _dist_version("wrapt")
    report = {
        "package_version": __version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "variable": {"name": _config.PREFIX, "value": raw, "enabled": settings.enabled},
        "pth": _pth_report(),
        "wrapt": {"version": wrapt_version,
                  "major": int(wrapt_version.split(".")[0]) if wrapt_version else None,
                  "imported": "wrapt" in sys.modules},
        "settings": dataclasses.asdict(settings),
    }
    report["flashinfer"] = _flashinfer_report(import_flashinfer)  # may register the hooks
    report["wrapt"]["imported"] = "wrapt" in sys.modules
    report["hooks_registered"] = _bootstrap.hooks_registered
    report["cuda"] = _cuda_report()
    report["waiting_for_flashinfer"] = _watching()
    report["active"] = bool(_patch.is_active()) or report["waiting_for_flashinfer"]
    report["why"] = _why(report)
    return report


def _why(r: dict) -> list:
    """Plain sentences: why the shim is (not) active, and what looks wrong."""
    lines = []
    var = r["variable"]
    from ._config import ParseError, parse_bool

    raw = var["value"]
    try:
        env_on = raw is not None and raw.strip() != "" and parse_bool(raw)
    except ParseError:
        env_on = False
    if r["active"]:
        if env_on:
            lines.append(f"{var['name']}={raw!r} turns the shim on")
        else:
            lines.append("activated in code by flashinfer_safe_workspace.install() "
                         f"({var['name']}={raw!r})")
    elif raw is None or not raw.strip():
        lines.append(f"{var['name']} is not set; set {var['name']}=1 to turn the shim on")
    elif not env_on:
        lines.append(f"{var['name']}={var['value']!r} does not turn the shim on "
                     "(on: 1/true/yes/on)")
    else:
        lines.append("the variable is on but the hooks are not registered: see the "
                     "warnings above (wrapt missing?)")
    pth = r["pth"]
    running = [e for e in pth["files"] if e["runs_at_start"]]
    if not running:
        lines.append(f"no {PTH_NAME} in a site-packages directory: the variable alone will "
                     "not activate the shim in new interpreters (reinstall the package, or "
                     "call install())")
    elif not pth["site_enabled"]:
        lines.append("python runs with -S: no .pth file runs, only install() activates")
    for entry in pth["files"]:
        if not entry["ok"]:
            lines.append(f"{entry['path']}: {entry['problem']}")
    if len(running) > 1:
        lines.append("more than one .pth in site directories: harmless (the bootstrap runs "
                     "once) but suggests two installs")
    fi = r["flashinfer"]
    if fi["version"] is None:
        lines.append("FlashInfer is not installed: nothing to wrap")
    elif not fi["verified"]:
        lines.append(f"FlashInfer {fi['version']}: {fi.get('note', 'rules not verified')}")
    if fi.get("import_error"):
        lines.append(f"import flashinfer.comm failed: {fi['import_error']}")
    elif r["active"] and fi["imported"] and not fi["wrapped"]:
        lines.append("active, flashinfer.comm imported, yet nothing is wrapped: this "
                     "FlashInfer has neither target function")
    if r["wrapt"]["version"] is None:
        lines.append("wrapt is not installed: the shim cannot hook FlashInfer")
    if r["cuda"]["error"]:
        lines.append(f"CUDA: {r['cuda']['error']} (the probe will vote no unless FAIL_OPEN)")
    return lines


def format_doctor(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    var = r["variable"]
    fi = r["flashinfer"]
    cuda = r["cuda"]
    out = [
        f"flashinfer_safe_workspace {r['package_version']} (python {r['python']}, {r['executable']})",
        f"  active in this interpreter: {yes(r['active'])}"
        + (" (hooks registered at the first import of flashinfer)"
           if r.get("waiting_for_flashinfer") else ""),
        f"  {var['name']}: {var['value']!r} -> enabled={var['enabled']}",
    ]
    if r["pth"]["files"]:
        for entry in r["pth"]["files"]:
            where = "runs at start" if entry["runs_at_start"] else "on sys.path only: not run"
            out.append(f"  .pth: {entry['path']} ({where})"
                       + ("" if entry["ok"] else f" ({entry['problem']})"))
    else:
        out.append(f"  .pth: not found ({PTH_NAME})")
    w = r["wrapt"]
    out.append(f"  wrapt: {w['version'] or 'not installed'} (major {w['major']}, "
               f"imported {yes(w['imported'])})")
    rules = fi["rules"] or "-"
    out.append(f"  FlashInfer: {fi['version'] or 'not installed'}, rules {rules}, "
               f"verified {yes(fi['verified'])} (newest mirrored {fi['newest_mirrored']})")
    if fi["wrapped"]:
        out.append("  wrapped now:")
        out += [f"    {name}" for name in fi["wrapped"]]
    else:
        out.append("  wrapped now: nothing" + ("" if fi["imported"] else
                                                " (flashinfer.comm not imported)"))
    if cuda["error"]:
        out.append(f"  CUDA: {cuda['error']}")
    else:
        out.append(f"  CUDA: driver {cuda['driver_version']}, {cuda['device_count']} device(s) "
                   f"({cuda['bindings']})")
    out.append("  settings: " + ", ".join(f"{k}={v!r}" for k, v in r["settings"].items()))
    from . import _caller

    out += ["  " + line for line in _caller.doctor_lines(r["settings"].get("on_veto", "auto"))]
    for line in r["why"]:
        out.append(f"  - {line}")
    return "\n".join(out)


def run_doctor(args) -> int:
    import json

    report = doctor_report(import_flashinfer=not args.no_import)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_doctor(report))
    return 0 if report["active"] else 1


# --------------------------------------------------------------------------- check


def check_report(*, backend: str, world_size: int, max_token_num: int, hidden_dim: int,
                 dtype: str, headroom_mb: Optional[int] = None, device: int = 0,
                 rank: int = 0, flashinfer_version: Optional[str] = None,
                 simulate_free_mb: Optional[int] = None) -> dict:
    """Plan one unified-API workspace for this GPU and probe it; never raises.

    ``status`` is ``fits`` / ``does-not-fit`` / ``cannot-tell``; ``exit_code`` the
    matching 0 / 1 / 2.
    """
    from . import _config, _plan, _probe, _releases

    settings = _config.current()
    headroom = settings.headroom_mb if headroom_mb is None else int(headroom_mb)
    version = flashinfer_version or _dist_version("flashinfer-python")
    r: dict = {"backend": backend, "world_size": world_size, "max_token_num": max_token_num,
               "hidden_dim": hidden_dim, "dtype": dtype, "device": device,
               "headroom_bytes": headroom * MiB, "flashinfer_version": version,
               "prober": "simulated" if simulate_free_mb is not None else "cuda",
               "plan": None, "peak_bytes": None, "free_bytes": None, "total_bytes": None,
               "probe_ok": None, "probe_ms": None, "headroom_left_bytes": None, "notes": []}

    def done(status: str, why: str) -> dict:
        r["status"], r["reason"] = status, why
        r["exit_code"] = {"fits": FITS, "does-not-fit": DOES_NOT_FIT}.get(status, CANNOT_TELL)
        return r

    if version is None:
        return done("cannot-tell", "FlashInfer is not installed and --flashinfer-version not given")
    try:
        if _releases.is_unknown(version):
            r["notes"].append(f"FlashInfer {version} is newer than the newest release mirrored "
                              f"({'.'.join(map(str, _releases.NEWEST[:3]))}): planned with the "
                              "newest rules")
    except _plan.Unplanned as exc:
        return done("cannot-tell", str(exc))
    if simulate_free_mb is not None:
        prober = _probe.SimulatedDevice(int(simulate_free_mb) * MiB, device=device)
    else:
        prober = _probe.CudaProber()
    cc = _config.flashinfer_confidential_compute_override() == "1"
    try:
        facts = prober.facts(device, cc, world_size)
    except _probe.ProbeUnavailable as exc:
        return done("cannot-tell", f"no usable CUDA driver or device: {exc}")
    except Exception as exc:  # the driver surprising us (bad ordinal, ...)
        return done("cannot-tell", f"could not query cuda:{device}: {type(exc).__name__}: {exc}")
    if backend == "auto":
        r["notes"].append("backend auto: resolved with this GPU's multicast support only; "
                          "FlashInfer asks every rank (one GPU without it picks trtllm)")
    req = _plan.Request(entry="unified", backend=backend, world_size=world_size, rank=rank,
                        max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=dtype)
    try:
        from ._decide import _size_aware_multicast

        facts = _size_aware_multicast(facts, prober, world_size)  # as the shim plans
        plan = _plan.make_plan(req, facts, version)
    except _plan.Unplanned as exc:
        return done("cannot-tell", f"no allocation rule for this call: {exc}")
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
    if r.get("plan_text"):
        out += ["  " + line for line in r["plan_text"].splitlines()]
    if r["probe_ok"] is not None:
        out.append(f"  free {gib(r['free_bytes'])} of {gib(r['total_bytes'])}; need "
                   f"{r['peak_bytes'] / MiB:.1f} MiB + headroom {r['headroom_bytes'] / MiB:.0f} MiB;"
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


# --------------------------------------------------------------------------- logs

# The INFO line every fresh decision logs (``_decide._log_decision``); a cached veto
# logs none. Any prefix a handler's format adds is allowed before ``fiws decision``.
DECISION_LINE = re.compile(
    r"fiws decision rank=(?P<rank>-|\d+) pid=(?P<pid>\d+) outcome=(?P<outcome>pass|veto)"
    r" entry=(?P<entry>unified|legacy) backend=(?P<backend>[a-z-]+)"
    r" ranks=(?P<ranks>\d+(?:,\d+)*) device=(?P<device>cuda:\d+|-)"
    r" plan_bytes=(?P<plan_bytes>-?\d+)"
    r" free_bytes=(?P<free_bytes>-?\d+) probe=(?P<probe>ok|no)"
    r" elapsed_ms=(?P<elapsed_ms>\d+\.\d+)$")


def parse_decision_lines(text: str) -> list:
    """Every decision line in ``text`` as a dict with typed values."""
    out = []
    for line in text.splitlines():
        match = DECISION_LINE.search(line.rstrip())
        if match is None:
            continue
        d = match.groupdict()
        d["rank"] = None if d["rank"] == "-" else int(d["rank"])
        d["ranks"] = [int(x) for x in d["ranks"].split(",")]
        for key in ("pid", "plan_bytes", "free_bytes"):
            d[key] = int(d[key])
        d["elapsed_ms"] = float(d["elapsed_ms"])
        out.append(d)
    return out
