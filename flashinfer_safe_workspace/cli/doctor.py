"""``doctor``: is the shim active in this interpreter, and why; the runtime facts it
would plan with here (torch's signal pad, the device's granularities); and whether every
call here would be vetoed (``preflight``).

Read-only: it may import ``flashinfer.comm`` to see what the hooks wrapped and asks
the driver for granularities (queries only: nothing is allocated).
"""

from __future__ import annotations

import dataclasses
import os
import site
import sys
import textwrap
from typing import Optional

PTH_NAME = "flashinfer_safe_workspace.pth"
START_NAME = "flashinfer_safe_workspace.start"  # PEP 829: run instead of the .pth line on 3.15+
WIDTH = 100  # doctor's lines are wrapped to this many characters
# doctor's exit codes (main.EXIT_CODES: 0 and 1 as every command's yes and no; 3 its own)
ACTIVE, NOT_ACTIVE, VETOES_ALL = 0, 1, 3


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


def find_pth_files(name: str = PTH_NAME) -> list:
    """``(path, runs_at_start)`` for every ``name`` (the ``.pth``, or the ``.start`` file)
    in a site directory (such files there run at start-up) or elsewhere on ``sys.path``
    (found, but Python does not run them from plain path entries)."""
    seen, found = set(), []
    site_dirs = _site_dirs()
    for runs, dirs in ((True, site_dirs), (False, [p for p in sys.path if p])):
        for d in dirs:
            real = os.path.realpath(d)
            if real in seen:
                continue
            seen.add(real)
            path = os.path.join(d, name)
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
        "start_files": [path for path, runs in find_pth_files(START_NAME) if runs],
        "site_dirs": _site_dirs(),
        "site_enabled": not sys.flags.no_site,  # -S: no .pth file runs at all
    }


def _range_words(label: str) -> str:
    """``R10`` -> ``"R10 (0.7.4's)"``; a range of several releases names its first and
    the next range's: ``"R9 (0.7.2.post1 up to 0.7.4)"``."""
    from ..planning import rules

    def name(key: tuple) -> str:
        return ".".join(map(str, key[:3])) + (f".post{key[3]}" if key[3] else "")

    firsts = [first for first, lab in rules.RANGES]
    i = [lab for _, lab in rules.RANGES].index(label)
    if i + 1 == len(firsts):
        return f"{label} ({name(firsts[i])}'s, the newest read)"
    return f"{label} ({name(firsts[i])} up to {name(firsts[i + 1])})"


# What a call does with a release whose source was not read, per UNKNOWN_VERSION
# (_decide.py, _local.py); "{rules}" is the range the release falls in.
UNKNOWN_VERSION_DOES = {
    "newest": "each call is planned with the rules of {rules}, probed and voted as usual",
    "pass-through": "each call goes to FlashInfer unprotected (no plan, no probe, no vote)",
    "veto": "every call is vetoed (reason UNKNOWN_VERSION)",
}


def unverified_line(version: str, label: str, setting: str) -> str:
    """One line for a FlashInfer release whose source was not read: what it is, and what
    each call does with it under this ``UNKNOWN_VERSION`` (``setting``)."""
    from .. import _config
    from ..planning import rules

    default = _config.BY_NAME[f"{_config.PREFIX}_UNKNOWN_VERSION"].default
    does = UNKNOWN_VERSION_DOES.get(setting, "?").format(rules=_range_words(label))
    return (f"FlashInfer {version} is {rules.unverified_why(version)}, so not verified: with "
            f"UNKNOWN_VERSION={setting}" + (" (the default)" if setting == default else "")
            + f" {does}")


def _flashinfer_report(import_comm: bool, unknown_version: str = "newest") -> dict:
    from ..activation import patch as _patch
    from ..planning import rules
    from ..planning.plan import Unplanned

    version = rules.flashinfer_version()
    out: dict = {"version": version, "rules": None, "verified": False, "newest_mirrored":
                 ".".join(map(str, rules.NEWEST[:3])), "imported": False,
                 "import_error": None, "wrapped": []}
    if version is None:
        out["note"] = "flashinfer-python is not installed"
        return out
    try:
        out["rules"] = rules.range_of(version)
        out["verified"] = not rules.is_unknown(version)
        if not out["verified"]:
            out["note"] = unverified_line(version, out["rules"], unknown_version)
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
        from ..planning import probe as _probe

        drv = _probe.driver_module()
        out["bindings"] = drv.__name__
    except Exception as exc:
        out["error"] = f"no cuda-python driver bindings: {exc}"
        return out
    try:
        from ..planning.probe import checked

        checked(drv.cuInit(0))
        version = int(checked(drv.cuDriverGetVersion()))
        out["driver_version"] = f"{version // 1000}.{(version % 1000) // 10}"
        out["device_count"] = int(checked(drv.cuDeviceGetCount()))
    except Exception as exc:
        name = getattr(exc, "name", "") or type(exc).__name__
        out["error"] = f"no driver: {name}: {exc}" if str(exc) != name else f"no driver: {name}"
    return out


def facts_report(cuda: dict, device: int = 0) -> dict:
    """The runtime facts the shim would plan with here: torch's signal pad always; the
    device's granularity and per-size multicast granularity (for a 2 MiB and a 1 GiB
    object, 2 devices) when the driver answers, else the H200 values ``plan`` uses."""
    from .. import _config
    from ..planning import facts as _facts, probe as _probe
    from ..planning.plan import MiB

    _, pad_source = _facts.signal_pad()
    if cuda.get("error") is None:
        try:
            cc = _config.flashinfer_confidential_compute_override() == "1"
            facts = _facts.runtime_facts(_probe.CudaProber(), device=device,
                                         confidential_compute=cc, world_size=2)
            source = f"cuda:{device}, driver"
        except Exception as exc:  # noqa: BLE001 - a report, never a crash
            facts, source = _facts.h200_facts(2), f"H200 values (cuda:{device}: {exc})"
    else:
        facts, source = _facts.h200_facts(2), "H200 values (no CUDA driver)"
    for size in (2 * MiB, 1024 * MiB):  # the two answers H200 gives
        facts.gmc(size)
    return _facts.describe(facts, pad_source=pad_source, source=source)


def _watching() -> bool:
    """The bootstrap's lazy watcher is on ``sys.meta_path``: the hooks get registered
    (and wrapt imported) at the first ``import flashinfer``."""
    from ..activation import bootstrap as _bootstrap

    return _bootstrap.watching()


def doctor_report(import_flashinfer: bool = True) -> dict:
    """Everything ``doctor`` prints, as one JSON-able dict."""
    from ..activation import bootstrap as _bootstrap, patch as _patch
    from .. import _config
    from .._version import __version__
    from . import preflight as _preflight

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
    report["flashinfer"] = _flashinfer_report(  # may register the hooks
        import_flashinfer, settings.unknown_version)
    report["wrapt"]["imported"] = "wrapt" in sys.modules
    report["hooks_registered"] = _bootstrap.hooks_registered
    report["cuda"] = _cuda_report()
    report["facts"] = facts_report(report["cuda"])
    report["checks"] = _preflight.checks_report(report["flashinfer"].get("version"), settings,
                                                driver_error=report["cuda"]["error"])
    report["vetoes_every_call"] = _preflight.vetoes_every_call(
        report["checks"], report["flashinfer"], settings, report["cuda"]["error"])
    # UNKNOWN_VERSION=pass-through with a release not read: no veto, no protection either
    report["unprotected"] = _preflight.unprotected(report["flashinfer"], settings)
    report["hidden_by_dash_s"] = _hidden_by_dash_s(report)
    report["cannot_tell"] = ""
    if (report["vetoes_every_call"] and "cuda-python" in report["hidden_by_dash_s"]
            and report["checks"].get("facts_error")
            and not _preflight.version_vetoes(report["flashinfer"], settings)):
        # the facts are unread only because -S hid the driver bindings: not a known veto
        report["vetoes_every_call"] = []
        report["cannot_tell"] = (
            "it cannot be told whether a workspace creation here can pass: cuda-python's "
            "driver bindings, which read this rank's facts, are not on this sys.path "
            "(site-packages is not searched, above)")
    report["waiting_for_flashinfer"] = _watching()
    report["active"] = bool(_patch.is_active()) or report["waiting_for_flashinfer"]
    # pth / start / plugin:vllm / plugin:sglang / plugin:aphrodite / sitecustomize / install()
    report["activated_by"] = _bootstrap.activated_by() if report["active"] else None
    report["why"] = _why(report)
    return report


def _hidden_by_dash_s(r: dict) -> list:
    """What doctor looked for and did not find, under ``python -S`` only: site-packages is
    not on ``sys.path`` there, so each may be installed there all the same."""
    if r["pth"]["site_enabled"]:
        return []
    return [name for name, missing in (("wrapt", r["wrapt"]["version"] is None),
                                       ("FlashInfer", r["flashinfer"]["version"] is None),
                                       ("cuda-python", r["cuda"]["bindings"] is None))
            if missing]


def _why(r: dict) -> list:
    """Plain sentences: why the shim is (not) active, and what looks wrong."""
    lines = []
    var = r["variable"]
    from .._config import ParseError, parse_bool

    raw = var["value"]
    try:
        env_on = raw is not None and raw.strip() != "" and parse_bool(raw)
    except ParseError:
        env_on = False
    if r["active"]:
        how = r.get("activated_by")
        if how == "install()":
            lines.append("activated in code by flashinfer_safe_workspace.install() "
                         f"({var['name']}={raw!r})")
        else:
            lines.append(f"{var['name']}={raw!r} turns the shim on (through {how or '?'})")
    elif raw is None or not raw.strip():
        lines.append(f"{var['name']} is not set; set {var['name']}=1 to turn the shim on")
    elif not env_on:
        lines.append(f"{var['name']}={var['value']!r} does not turn the shim on "
                     "(on: 1/true/yes/on)")
    elif r["pth"]["site_enabled"]:  # under -S the -S line below says why
        lines.append("the variable is on but the hooks are not registered: see the "
                     "warnings above (wrapt missing?)")
    pth = r["pth"]
    running = [e for e in pth["files"] if e["runs_at_start"]]
    if not pth["site_enabled"]:  # the .pth may be installed fine: -S skips every one
        lines.append("python runs with -S (the site module is off): no .pth file runs and "
                     "site-packages is not on sys.path, so the variable cannot activate the "
                     "shim here, and what is installed there is not found; run "
                     "python without -S, or call flashinfer_safe_workspace.install() in code")
    elif not running:
        lines.append(f"no {PTH_NAME} in a site-packages directory: the variable alone will "
                     "not activate the shim in new interpreters (reinstall the package, or "
                     "call install())")
    for entry in pth["files"]:
        if not entry["ok"]:
            lines.append(f"{entry['path']}: {entry['problem']}")
    if len(running) > 1:
        lines.append("more than one .pth in site directories: harmless (the bootstrap runs "
                     "once) but suggests two installs")
    fi = r["flashinfer"]
    hidden = r.get("hidden_by_dash_s") or []
    if hidden:
        lines.append(f"not found on this sys.path: {', '.join(hidden)}; site-packages is not "
                     "searched (above), so whether they are installed there cannot be told")
    if fi["version"] is None:
        if "FlashInfer" not in hidden:
            lines.append("FlashInfer is not installed: nothing to wrap")
    elif not fi["verified"]:
        lines.append(fi.get("note") or f"FlashInfer {fi['version']}: rules not verified")
    if fi.get("import_error"):
        lines.append(f"import flashinfer.comm failed: {fi['import_error']}")
    elif r["active"] and fi["imported"] and not fi["wrapped"]:
        lines.append("active, flashinfer.comm imported, yet nothing is wrapped: this "
                     "FlashInfer has neither target function")
    if r["wrapt"]["version"] is None and "wrapt" not in hidden:
        lines.append("wrapt is not installed: the shim cannot hook FlashInfer")
    if r.get("cannot_tell"):
        lines.append(r["cannot_tell"])
    if r.get("vetoes_every_call"):
        lines.append(("every workspace creation here would be vetoed" if r["active"] else
                      "once turned on, every workspace creation here would be vetoed")
                     + ": " + "; ".join(r["vetoes_every_call"]))
    return lines


def format_doctor(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    var = r["variable"]
    fi = r["flashinfer"]
    cuda = r["cuda"]
    out = [
        f"flashinfer_safe_workspace {r['package_version']} (python {r['python']}, {r['executable']})",
        f"  active in this interpreter: {yes(r['active'])}"
        + (f", activated by {r['activated_by']}" if r.get("activated_by") else "")
        + (" (hooks registered at the first import of flashinfer)"
           if r.get("waiting_for_flashinfer") else "")
        + (", but every call here would be vetoed (below)"
           if r["active"] and r.get("vetoes_every_call") else "")
        + (", but each call goes to FlashInfer unprotected (UNKNOWN_VERSION=pass-through, below)"
           if r["active"] and r.get("unprotected") else ""),
        f"  {var['name']}: {var['value']!r} -> enabled={var['enabled']}",
    ]
    if r["pth"]["files"]:
        for entry in r["pth"]["files"]:
            where = "runs at start" if entry["runs_at_start"] else "on sys.path only: not run"
            out.append(f"  .pth: {entry['path']} ({where})"
                       + ("" if entry["ok"] else f" ({entry['problem']})"))
    else:
        out.append(f"  .pth: not found ({PTH_NAME})" + (
            "" if r["pth"]["site_enabled"] else ": python -S does not search site-packages"))
    for path in r["pth"].get("start_files", []):
        out.append(f"  .start: {path} (Python 3.15+ runs it instead of the .pth line)")
    w = r["wrapt"]
    unseen = "not found (python -S)" if r.get("hidden_by_dash_s") else "not installed"
    out.append(f"  wrapt: {w['version'] or unseen} (major {w['major']}, "
               f"imported {yes(w['imported'])})")
    rules = fi["rules"] or "-"
    out.append(f"  FlashInfer: {fi['version'] or unseen}, rules {rules}, "
               f"verified {yes(fi['verified'])} (newest mirrored {fi['newest_mirrored']})")
    if fi["wrapped"]:
        out.append("  wrapped now:")
        out += [f"    {name}" for name in fi["wrapped"]]
    else:
        out.append("  wrapped now: nothing" + ("" if fi["imported"] else
                                                " (flashinfer.comm not imported)"))
    if cuda["error"]:  # said once, here
        out.append(f"  CUDA: {cuda['error']} " + (
            "(python -S: site-packages is not searched)"
            if "cuda-python" in r.get("hidden_by_dash_s", []) else
            "(the probe will vote no unless FAIL_OPEN)"))
    else:
        out.append(f"  CUDA: driver {cuda['driver_version']}, {cuda['device_count']} device(s) "
                   f"({cuda['bindings']})")
    if r.get("facts"):
        from ..planning.facts import format_facts

        out.append("  " + format_facts(r["facts"]))
    if r.get("checks"):
        from .preflight import format_checks

        out += format_checks(r["checks"], cuda["error"], r.get("unprotected", ""))
    out.append("  settings: " + ", ".join(f"{k}={v!r}" for k, v in r["settings"].items()))
    from ..audit import compare as _audit
    from .. import _caller

    out += ["  " + line for line in _caller.doctor_lines(r["settings"].get("on_veto", "auto"))]
    last = _audit.last()
    out.append("  last audit in this process: " + (
        "none (no workspace created here yet)" if last is None else
        f"{last.status}" + (f" ({last.reason})" if last.reason else "")
        + (f"; {last.report_line()}" if last.status == "mismatch" else "")))
    for line in r["why"]:
        out.append(f"  - {line}")
    return "\n".join(wrapped for line in out for wrapped in _wrap(line))


def _wrap(line: str) -> list:
    """``line`` in pieces of at most ``WIDTH`` characters where it has spaces to break at,
    continued four spaces deeper than it starts."""
    if len(line) <= WIDTH:
        return [line]
    indent = line[:len(line) - len(line.lstrip())]
    return textwrap.wrap(line, width=WIDTH, subsequent_indent=indent + "    ",
                         break_long_words=False, break_on_hyphens=False) or [line]


def run_doctor(args) -> int:
    """Exit 0: active, and a call can pass here (under ``UNKNOWN_VERSION=pass-through`` with
    a release not read, unprotected: the report says so); 1: not active; 3: active, but every
    call here would be vetoed (the report says which check, per backend)."""
    import json

    report = doctor_report(import_flashinfer=not args.no_import)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_doctor(report))
    if not report["active"]:
        return NOT_ACTIVE
    return VETOES_ALL if report["vetoes_every_call"] else ACTIVE

