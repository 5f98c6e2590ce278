"""What every check shares: the context it reads, its answer, and the path's traits.

A check is a module with ``NAME``, ``CODE``, ``MODES`` (rows of docs/failure-modes.md),
``RELEASES`` (where the release really fails, in words), ``applies(ctx)`` (:func:`every_release`
for a check that applies everywhere), and ``local(ctx) -> CheckResult`` and/or
``compare(records) -> Failure | None`` (:func:`differ` for "the ranks must agree on this").
``value`` is ``"k=v k=v"`` text: small, the same format on every rank, compared as text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..agreement.record import CheckResult
from ..planning.rankfacts import RankFacts


class FactsUnavailable(RuntimeError):
    """This rank's facts could not be read: a check needing them fails closed with
    ``CHECK_ERROR``. Whoever read the facts reported that failure once (``rank_facts``),
    so the checks do not report it again as an internal error of their own."""


@dataclasses.dataclass
class Context:
    req: Any  # planning.plan.Request
    version: str
    traits: Any  # rules.Traits of the release, or None (unparsable / unmirrored)
    members: Any  # agreement.group.Members
    settings: Any
    bound: dict  # the call's bound arguments (group, comm_backend)
    rank: Optional[RankFacts]  # None: the facts could not be read (checks needing them fail)
    cc: bool = False  # confidential compute as FlashInfer sees it
    extra: dict = dataclasses.field(default_factory=dict)  # the deep probe's round key etc.

    def facts(self) -> RankFacts:
        if self.rank is None:
            raise FactsUnavailable(self.extra.get("facts_error")
                                   or "this rank's facts could not be read")
        return self.rank

    @property
    def backend(self) -> str:
        return str(self.req.backend)

    @property
    def allocator(self) -> str:
        """The allocator FlashInfer's path uses in this release (``""``: unknown)."""
        t, req = self.traits, self.req
        if t is None:
            return ""
        if req.entry == "legacy":
            return (t.legacy_symm or t.legacy_default) if req.use_symm_dev_mem else t.legacy_default
        if self.backend == "mnnvl-cutedsl":
            return "D"
        if self.backend == "trtllm" and t.confidential_compute and self.cc:
            return "C"
        return t.mnnvl if self.backend in ("mnnvl", "auto") else t.trtllm

    @property
    def makes_multicast(self) -> bool:
        """Whether the path creates a multicast object whatever the peers say: a named
        mnnvl / mnnvl-cutedsl, or auto before 0.6.16 (always mnnvl there)."""
        if self.req.entry == "legacy" or self.traits is None:
            return False
        if self.backend in ("mnnvl", "mnnvl-cutedsl"):
            return True
        return self.backend == "auto" and not self.traits.auto_vote


@dataclasses.dataclass(frozen=True)
class Failure:
    """A cross-rank check that failed: which check, and who holds which value."""

    check: str
    code: int
    text: str
    by_value: tuple = ()  # ((value, (positions...)), ...)


def fields(value: str) -> dict:
    """``"a=1 b=x"`` -> ``{"a": "1", "b": "x"}``."""
    out = {}
    for part in str(value).split():
        key, _, val = part.partition("=")
        out[key] = val
    return out


def ok(value: str = "", note: str = "") -> CheckResult:
    return CheckResult(True, 0, value, note)


def fail(code: int, value: str, note: str) -> CheckResult:
    return CheckResult(False, int(code), value, note[:300])


def applying(records: list, name: str) -> list:
    """``(position, CheckResult)`` of the records in which check ``name`` applied."""
    out = []
    for pos, rec in enumerate(records):
        res = rec.checks.get(name)
        if res is not None and res.applies:
            out.append((pos, res))
    return out


def every_release(ctx) -> bool:
    """``applies`` of a check that every release and path can fail."""
    return True


def group_by(pairs, key) -> tuple:
    """((value, positions), ...) sorted by first position."""
    by: dict = {}
    for pos, res in pairs:
        by.setdefault(key(res), []).append(pos)
    return tuple(sorted(((k, tuple(v)) for k, v in by.items()), key=lambda kv: kv[1][0]))


def by_field(key: str):
    """A grouping key for :func:`group_by`: ``"key=v"`` of a result's value (``"key=?"``
    where the value has no ``key``)."""
    return lambda res: f"{key}=" + fields(res.value).get(key, "?")


def whole_value(res) -> str:
    """A grouping key for :func:`group_by`: the result's whole value."""
    return res.value


def differ(records: list, name: str, key, code: int, text: str) -> Optional[Failure]:
    """Check ``name`` failing with ``code`` when the ranks it applied on hold more than
    one ``key(result)`` (who holds which, in the failure); None when they all agree."""
    groups = group_by(applying(records, name), key)
    return Failure(name, code, text, groups) if len(groups) > 1 else None


def handle_of(ctx: Context) -> str:
    """The handle type this rank's FlashInfer would choose for its path."""
    from ..planning.probe import flashinfer_picks_fabric

    alloc = ctx.allocator
    if alloc == "A":
        return "cudaipc"
    if alloc in ("C", "D"):
        return "torch"
    if alloc == "B4":
        return "vote"  # 0.7.4 votes on it and falls back to POSIX on one host
    f = ctx.facts()
    return "fabric" if f.fabric_handles and flashinfer_picks_fabric(f.fabric) else "posix"
