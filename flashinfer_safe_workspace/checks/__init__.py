"""The preflight as a list of checks, each in its own module with its own reason code.

``LOCAL`` runs on every rank before the plan and the probe (``memory``, last); a check
that raises is a failed check with ``CHECK_ERROR`` (fail-closed, never a traceback into
the engine). ``CROSS`` compares the facts every rank published in its record; ``_decide`` hands
:func:`compare` to the agreement (``vote.use_comparison``), whose ``resolve`` runs it, so
every rank reaches the same answer from the same records. ``ALL`` is what ``doctor`` lists and docs/failure-modes.md maps.
"""

from __future__ import annotations

import re

from .. import _reasons as R
from .._log import internal_error
from ..agreement.record import CheckResult
from . import capture, deep, device, fabric, gpus, group, handles, hosts, memory, multicast, packages
from .base import Context, Failure, FactsUnavailable

LOCAL = (group, capture, packages, device, gpus, multicast, fabric, hosts, handles)
CROSS = (packages, gpus, multicast, hosts, handles)
ALL = LOCAL + (deep, memory)

__all__ = ["ALL", "CROSS", "LOCAL", "Context", "Failure", "FactsUnavailable", "compare",
           "run_local", "first_failure", "traits_for"]


def traits_for(version):
    """The release traits the checks read for ``version`` (None: no version, unparsable,
    or older than every rule; the checks that need them then do not apply)."""
    from ..planning import rules

    try:
        return rules.traits(version) if version else None
    except Exception:  # noqa: BLE001
        return None


def run_one(check, ctx) -> CheckResult:
    try:
        if not check.applies(ctx):
            return CheckResult(True, R.OK, "", "", applies=False)
        return check.local(ctx)
    except Exception as exc:  # noqa: BLE001 - a check that fails is a no (or a yes with FAIL_OPEN)
        if not isinstance(exc, FactsUnavailable):  # that one was reported where it was read
            internal_error(f"check.{check.NAME}", exc)
        return CheckResult(bool(getattr(ctx.settings, "fail_open", False)), R.CHECK_ERROR,
                           f"check={check.NAME}", f"{type(exc).__name__}: {exc}"[:300])


def run_local(ctx) -> dict:
    """``{name: CheckResult}`` for every local check, in order (each always answers)."""
    return {check.NAME: run_one(check, ctx) for check in LOCAL}


def first_failure(results: dict):
    """``(name, CheckResult)`` of the first failed check, or None."""
    return next(((n, r) for n, r in results.items() if not r.ok), None)


_NAMED = re.compile(r"check ([a-z-]+):")


def named_in(text: str) -> str:
    """The check a veto text names (a register decided before this rank arrived carries
    the deciding rank's reasons as text), or ``""``."""
    match = _NAMED.search(text or "")
    return match.group(1) if match else ""


def compare(records: list) -> list:
    """Every cross-rank check that fails on these records (pure: the same on every rank)."""
    out = []
    for check in CROSS:
        try:
            failure = check.compare(records)
        except Exception as exc:  # noqa: BLE001 - fail closed, the same on every rank
            failure = Failure(check.NAME, R.CHECK_ERROR, f"comparison failed: "
                              f"{type(exc).__name__}: {exc}"[:200])
        if failure is not None:
            out.append(failure)
    return out
