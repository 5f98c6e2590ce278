"""``doctor``'s preflight section: what every check answers on this host, and whether
every creation call here would be vetoed (``doctor`` then exits 3 instead of 0), or goes to
FlashInfer unprotected (``UNKNOWN_VERSION=pass-through``: no check runs at all).

The checks run as a decision runs them (``checks.run_local``), for a two-rank call per
backend; the cross-rank checks need peers and are listed with their local facts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

BACKENDS = ("trtllm", "mnnvl")  # what backend="auto" resolves to; each is asked
FACTS_GONE = "FactsUnavailable"  # a check's note when this rank's facts could not be read


def checks_report(version, settings, backends=BACKENDS,
                  driver_error: Optional[str] = None) -> dict:
    """Every preflight check's verdict on this host, for a two-rank call per backend.
    ``driver_error``: the CUDA line's error, already said once; a check that needs the
    facts then names it in a few words instead of repeating it."""
    from .. import checks as _checks
    from ..agreement.group import Members
    from ..planning import probe as _probe
    from ..planning.plan import Request

    from .. import _reasons as R

    try:
        rank, error, code = _probe.get_prober().rank_facts(), "", R.OK
    except Exception as exc:  # noqa: BLE001 - shown, and every check that needs them fails
        rank, error = None, f"{type(exc).__name__}: {exc}"
        # the code a decision gives when it cannot read the facts (before any check)
        code = R.NO_DEVICE if isinstance(exc, _probe.ProbeUnavailable) else R.DRIVER_ERROR
    out = {"facts_error": error, "facts_code": code,
           "facts": dataclasses.asdict(rank) if rank else None}
    short = ("needs this rank's facts (no CUDA driver, above)"
             if driver_error else f"needs this rank's facts, not read: {error}")
    for backend in backends:
        req = Request("unified", backend, 2, 0, 2048, 4096, "bfloat16")
        ctx = _checks.Context(req, version or "", _checks.traits_for(version),
                              Members("local", (0, 1), 0, "doctor"), settings, {}, rank,
                              extra={"facts_error": short})
        rows = _checks.run_local(ctx)
        out[backend] = [{"check": c.NAME, "modes": list(c.MODES), "releases": c.RELEASES,
                         **dataclasses.asdict(rows[c.NAME])} if c.NAME in rows else
                        {"check": c.NAME, "modes": list(c.MODES), "releases": c.RELEASES,
                         "ok": None, "applies": None, "value": "decided per call", "code": 0,
                         "note": ""} for c in _checks.ALL]
    return out


def format_checks(rep: dict, driver_error: Optional[str] = None,
                  unprotected: str = "") -> list:
    out = ["  preflight checks on this host (a 2-rank call, FlashInfer's release"
           + ("; none runs at run time: UNKNOWN_VERSION=pass-through" if unprotected else "")
           + "):"]
    if rep.get("facts_error"):
        out.append("    facts: not read (no CUDA driver: see CUDA above)" if driver_error
                   else f"    facts: {rep['facts_error']}")
    for backend in BACKENDS:
        for row in rep.get(backend, []):
            verdict = ("n/a" if row["applies"] is False else "per call" if row["ok"] is None
                       else "ok" if row["ok"] else f"VETO ({row['code']})")
            note = _note(row)
            out.append((f"    {backend:7s} {row['check']:9s} {verdict:10s} {row['value']}"
                        + (f" - {note}" if note else "")).rstrip())
    return out


def _note(row: dict) -> str:
    return str(row.get("note") or "").replace(f"{FACTS_GONE}: ", "")


def unprotected(flashinfer: dict, settings) -> str:
    """Why each call here goes to FlashInfer unprotected, or ''. A release whose source was
    not read under ``UNKNOWN_VERSION=pass-through``: a decision calls FlashInfer at once,
    before any fact is read or any check runs (``_decide.decide``), so nothing here vetoes."""
    if (flashinfer.get("rules") and not flashinfer.get("verified")
            and settings.unknown_version == "pass-through"):
        return (f"FlashInfer {flashinfer['version']} is not a release whose rules were "
                "verified and UNKNOWN_VERSION=pass-through: no plan, no check, no probe, "
                "no vote")
    return ""


def version_vetoes(flashinfer: dict, settings) -> str:
    """Why ``UNKNOWN_VERSION=veto`` vetoes every call of this release, or ''."""
    from .. import _reasons as R

    if (flashinfer.get("rules") and not flashinfer.get("verified")
            and settings.unknown_version == "veto"):
        return (f"FlashInfer {flashinfer['version']} is not a release whose rules were "
                f"verified and UNKNOWN_VERSION=veto ({R.NAMES[R.UNKNOWN_VERSION]})")
    return ""


def vetoes_every_call(rep: dict, flashinfer: dict, settings,
                      driver_error: Optional[str] = None) -> list:
    """Why every creation call here would be vetoed: one line per backend, or the one
    cause that vetoes them all (``driver_error``: said on the CUDA line, not again);
    ``[]`` when a call can pass. A check that fails for one backend only leaves the
    other's calls: that is not every call. Under ``unprotected`` no call is vetoed."""
    from .. import _reasons as R

    if unprotected(flashinfer, settings):
        return []
    version = version_vetoes(flashinfer, settings)
    if version:
        return [version]
    if rep.get("facts_error") and not settings.fail_open:  # a decision stops there
        why = "no usable CUDA driver, see CUDA above" if driver_error else rep["facts_error"]
        return [f"this rank's facts cannot be read, a no before any check "
                f"({R.NAMES.get(rep.get('facts_code'), '?')}: {why})"]
    lines = []
    for backend in BACKENDS:
        row = next((r for r in rep.get(backend, []) if r["ok"] is False), None)
        if row is None:
            return []
        name = R.NAMES.get(row["code"], str(row["code"]))
        lines.append(f"{backend}: check {row['check']} vetoes ({name}): "
                     f"{_note(row) or row['value']}")
    return lines
