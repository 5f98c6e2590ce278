"""What a vetoed caller gets (``ON_VETO=auto|none|raise``): the engine table and the
caller resolution.

``auto`` (the default) looks at the nearest calling frame outside FlashInfer, wrapt
and this package. When its module belongs to an engine in :data:`ENGINES` (all of
them fall back to their non-fused path on an exception, and some of them go wrong
on ``None``), the veto raises ``WorkspaceVetoed``; every other caller gets ``None``,
as the design asks. The module namespace decides, not an installed version: forks
reuse module names with their own numbering, installed metadata can disagree with
the code that runs, and SGLang re-binds the function at import; only the calling
frame is reliable. ``none`` and ``raise`` always win; the legacy tuple-returning
entry always raises.

Cheap and safe: one walk up ``sys._getframe`` reading ``f_globals["__name__"]`` (no
source files read, no engine imported), and :func:`resolve` never raises.
"""

from __future__ import annotations

import dataclasses
import sys

AUTO, NONE, RAISE = "auto", "none", "raise"
CHOICES = (AUTO, NONE, RAISE)


@dataclasses.dataclass(frozen=True)
class Engine:
    prefix: str  # module namespace: "vllm" matches "vllm" and "vllm.*"
    name: str
    releases: str  # the releases whose call-site code justifies the entry
    on_none: str  # what the engine does with None
    on_exception: str  # what it does with WorkspaceVetoed
    why_raise: str  # in one clause, why ``auto`` raises for it (the answer's ``why``)


# The one table. Every engine here falls back on an exception in every release read
# (tests/engines runs each named release's own call-site code; docs/engines.md).
ENGINES: tuple = (
    Engine("vllm", "vLLM", "0.15.0, 0.17.0, 0.18.0, 0.20.0, 0.22.0, 0.26.0, 0.33.0",
           "0.17/0.18: an AssertionError that is caught (under python -O, read not run, the "
           "None is stored and dereferenced in the forward); 0.33: caught only as None.destroy(), and "
           "id(None) is registered for the group",
           "non-fused from 0.17 (0.15 uses the legacy entry, which always raises: a clean "
           "start-up failure on every rank)",
           "vLLM 0.17 stores None under python -O; 0.33 registers id(None) for the group"),
    Engine("sglang", "SGLang", "0.5.8, 0.5.10.post1, 0.5.14, 0.5.17, 0.5.19, 0.5.23",
           "0.5.14-0.5.16 drop an all-reduce on None (silently wrong output); 0.5.10.post1 "
           "crashes in the forward",
           "non-fused from 0.5.9 (0.5.8 uses the legacy entry, which always raises)",
           "SGLang 0.5.14-0.5.16 drop an all-reduce on None"),
    Engine("lmdeploy", "lmdeploy", "0.18.0",
           "non-fused (it checks for None itself)", "non-fused",
           "lmdeploy 0.18 is non-fused either way; the exception carries the reason"),
    Engine("aphrodite", "aphrodite-engine", "0.24.1",
           "a vLLM fork: None.destroy() caught, id(None) registered for the group (a "
           "second group over the same ranks then raises), no failure latch",
           "non-fused", "aphrodite 0.24.1 registers id(None) for the group"),
)

# frames skipped when looking for the caller
_SKIP = ("flashinfer_safe_workspace", "flashinfer", "wrapt")

@dataclasses.dataclass(frozen=True)
class Answer:
    kind: str  # "none" | "raise"
    caller: str  # module of the nearest frame outside flashinfer, wrapt and us, or "-"
    why: str


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def engine_of(module: str):
    """The :class:`Engine` whose namespace holds ``module``, or ``None``."""
    try:
        return _engines_of[module]
    except KeyError:
        pass
    found = next((engine for engine in ENGINES if _in(module, engine.prefix)), None)
    _engines_of[module] = found
    return found


_engines_of: dict = {}  # module name -> its Engine or None (the table never changes)


def caller_module(depth: int = 1) -> str:
    """Module name of the nearest frame (above ``depth``) outside FlashInfer, wrapt and
    this package; ``"-"`` when there is none or it has no name."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return "-"
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not isinstance(name, str) or not name:
            return "-"
        skip = _skipped.get(name)
        if skip is None:
            skip = _skipped[name] = any(_in(name, p) for p in _SKIP)
        if not skip:
            return name
        frame = frame.f_back
    return "-"


_skipped: dict = {}  # module name -> whether caller_module looks past its frames


def resolve(on_veto: str, entry: str, need_caller: bool = True) -> Answer:
    """What this vetoed call gets. Never raises: on any error of ours, ``raise`` (every
    engine in the table and every ``except Exception`` caller survives it). The calling
    module is looked up only under ``ON_VETO=auto`` or when ``need_caller`` (a log line
    names it); otherwise ``caller`` is ``"-"``."""
    try:
        fixed = (RAISE, "legacy entry always raises") if entry == "legacy" else (
            (RAISE, "ON_VETO=raise") if on_veto == RAISE else
            (NONE, "ON_VETO=none") if on_veto == NONE else None)
        if fixed is not None:
            return Answer(fixed[0], caller_module(2) if need_caller else "-", fixed[1])
        caller = caller_module(2)
        engine = engine_of(caller)
        if engine is not None:
            return Answer(RAISE, caller, f"auto: {engine.prefix} falls back on an exception "
                                         f"({engine.why_raise})")
        return Answer(NONE, caller, "auto: not a known engine, None as the design asks")
    except Exception as exc:  # noqa: BLE001 - our code never crashes the host
        return Answer(RAISE, "-", f"caller resolution failed ({type(exc).__name__}); raise")


def fields(answer: Answer) -> str:
    """The text appended to the decision line: ``answer=raise caller=sglang.srt...``."""
    return f"answer={answer.kind} caller={answer.caller}"


def doctor_lines(on_veto: str = AUTO) -> list:
    """``doctor``'s section: what a veto returns under ``on_veto`` and the engine table."""
    if on_veto == RAISE:
        head = "on veto: WorkspaceVetoed for every caller (ON_VETO=raise)"
    elif on_veto == NONE:
        head = "on veto: None for every caller (ON_VETO=none); the legacy entry raises"
    else:
        prefixes = ", ".join(e.prefix + "." for e in ENGINES)
        head = (f"on veto (ON_VETO=auto): WorkspaceVetoed for callers in {prefixes}; None for "
                "every other caller; the legacy entry raises")
    lines = [head]
    for e in ENGINES:
        lines.append(f"  {e.prefix + '.':<11} {e.name} (verified: {e.releases}) -> auto answers "
                     f"raise; on None: {e.on_none}; on an exception: {e.on_exception}")
    return lines
