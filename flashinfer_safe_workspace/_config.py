"""The one table of environment variables, their parsers, and a frozen Settings.

Nothing else in the package reads ``os.environ``. A malformed value never raises:
it logs one warning (per variable and value) and the default is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import threading
from typing import Any, Callable, Mapping, NamedTuple

from ._switch import OFF as _FALSE, ON as _TRUE, VARIABLE as PREFIX  # one home

_log = logging.getLogger("flashinfer_safe_workspace")


class ParseError(ValueError):
    """A value that does not fit a variable's grammar."""


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ParseError("expected one of 1/true/yes/on or 0/false/no/off")


def _said(bound: float) -> str:
    """A bound as the warning says it: 1048576, 86400, 0.5 (not 1.04858e+06)."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _number(kind: Callable[[str], Any], minimum: float, allow_zero: bool = True,
            maximum: float = math.inf):
    def parse(text: str):
        what = "a whole number" if kind is int else "a number"
        try:
            # int() and float() also read '𝟠', '٨' and '1_0'
            if not text.strip().isascii() or "_" in text:
                raise ValueError(text)
            value = kind(text.strip())
        except ValueError:
            raise ParseError(f"expected {what} in the digits 0-9") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ParseError("expected a finite number")
        if value < minimum or (value == 0 and not allow_zero):
            raise ParseError(
                f"expected a number {'>' if not allow_zero else '>='} {_said(minimum)}"
            )
        if value > maximum:
            raise ParseError(f"expected at most {_said(maximum)}")
        return value

    return parse


def _auto_or(parse_number: Callable[[str], Any]):
    def parse(text: str):
        if text.strip().lower() == "auto":
            return "auto"
        return parse_number(text)

    return parse


DAY_S = 86400.0  # no wait of ours is meant to be longer


def _choice(*choices: str):
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ParseError("expected one of " + "|".join(choices))
        return value

    return parse


class Var(NamedTuple):
    name: str  # full variable name
    field: str  # Settings attribute
    kind: str  # shown in the docs/settings.md table
    default: Any
    parse: Callable[[str], Any]
    meaning: str


# The single source of truth. docs/settings.md's table is checked against it by a test.
VARIABLES: tuple[Var, ...] = (
    Var(PREFIX, "enabled", "bool", False, parse_bool,
        "Master switch for every activation path (the `.pth` line, the `.start` file, the "
        "engines' plugins): on, the shim is active in every process that inherits it. The "
        "only variable the gate looks at."),
    Var(f"{PREFIX}_ON_VETO", "on_veto", "auto\\|none\\|raise", "auto",
        _choice("auto", "none", "raise"),
        "What a rank gets when the vote vetoes. `auto`: `WorkspaceVetoed` raised when the "
        "caller's module is in an engine namespace of `_caller.ENGINES` (`vllm.`, `sglang.`, "
        "`lmdeploy.`, `aphrodite.`), `None` for every other caller. `none`/`raise`: that, for "
        "every caller. The legacy tuple-returning function always raises."),
    Var(f"{PREFIX}_HEADROOM_MB", "headroom_mb", "auto\\|int MiB 0–1048576", "auto",
        _auto_or(_number(int, 0, maximum=1 << 20)),
        "Extra device memory each rank must be able to hold on top of the plan's peak. "
        "`auto`: the NCCL start-up reserve when FlashInfer's collectives will start an NCCL "
        "communicator, a small reserve otherwise (see the design notes); a number: that many MiB."),
    Var(f"{PREFIX}_VOTE_TIMEOUT", "vote_timeout", "seconds, 0 < t <= 86400", 120.0,
        _number(float, 0, allow_zero=False, maximum=DAY_S),
        "Bound on the decision. A rank that has not answered in time is a veto on every rank; "
        "every rank returns within it plus 2 s."),
    Var(f"{PREFIX}_FAIL_OPEN", "fail_open", "bool", False, parse_bool,
        "When our own code fails on a rank (no driver, unplanned case, bug), vote yes "
        "instead of no."),
    Var(f"{PREFIX}_UNKNOWN_VERSION", "unknown_version", "newest\\|pass-through\\|veto",
        "newest", _choice("newest", "pass-through", "veto"),
        "A FlashInfer release whose source was not read (newer than 0.7.4, a post or "
        "pre-release not read, a dev or local build): plan with its range's rules (the "
        "newest for a newer release), call FlashInfer unprotected, or veto."),
    Var(f"{PREFIX}_CREATE_TIMEOUT", "create_timeout", "seconds 0–86400 (0 = off)", 0.0,
        _number(float, 0, maximum=DAY_S),
        "Watchdog on FlashInfer's own creation call after a yes vote: past it, log what "
        "the rank is waiting for (and abort with ON_HANG=abort)."),
    Var(f"{PREFIX}_ON_HANG", "on_hang", "log\\|abort", "log", _choice("log", "abort"),
        "What the creation watchdog does when it fires."),
    Var(f"{PREFIX}_DEEP_PROBE", "deep_probe", "bool", False, parse_bool,
        "Opt-in deep probe: the ranks of one host export one granule with FlashInfer's "
        "handle type and import each other's through the store (bounded by half the vote "
        "time left; released on every path). Catches handle, fd-passing and IPC failures."),
    Var(f"{PREFIX}_DEBUG", "debug", "bool", False, parse_bool,
        "Debug logging to stderr, one line per step, prefixed with pid and rank."),
)

BY_NAME = {var.name: var for var in VARIABLES}


def _headroom_bytes(self):
    """The headroom in bytes, or None for ``auto`` (resolved per call)."""
    return None if self.headroom_mb == "auto" else int(self.headroom_mb) << 20


# Settings: one frozen field per variable, its default from the table (no second list).
Settings = dataclasses.make_dataclass(
    "Settings", [(var.field, type(var.default), dataclasses.field(default=var.default))
                 for var in VARIABLES],
    frozen=True, namespace={"headroom_bytes": property(_headroom_bytes),
                            "__module__": __name__})


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(var: Var, raw: str, why: str) -> None:
    key = (var.name, raw)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    _log.warning(
        "flashinfer_safe_workspace: ignoring %s=%r (%s); using the default %r",
        var.name, raw, why, var.default,
    )


def _warn_unknown(name: str) -> None:
    key = (name, "")
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    tails = {var.name[len(PREFIX):]: var.name for var in VARIABLES}  # compare what differs
    close = difflib.get_close_matches(name[len(PREFIX):], list(tails), n=1, cutoff=0.6)
    hint = f"; did you mean {tails[close[0]]}?" if close else ""
    _log.warning("flashinfer_safe_workspace: unknown variable %s is ignored%s", name, hint)


def read_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from ``environ`` (default: the process environment) and overrides.

    Precedence: keyword overrides > environment > defaults. Overrides are validated
    with the same parsers (given as strings or already-typed values); a bad override
    raises ``ValueError`` because it comes from code, not from an operator's shell.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in env:
        if name.startswith(PREFIX + "_") and name not in BY_NAME and name != DEMO_PARENT:
            _warn_unknown(name)
    for var in VARIABLES:
        raw = env.get(var.name)
        if raw is None or raw.strip() == "":
            continue  # empty means unset
        try:
            values[var.field] = var.parse(raw)
        except ParseError as exc:
            _warn_once(var, raw, str(exc))
    fields = {var.field: var for var in VARIABLES}
    for key, value in overrides.items():
        if key not in fields:
            raise TypeError(f"unknown setting {key!r}")
        var = fields[key]
        if isinstance(value, str):
            try:
                value = var.parse(value)
            except ParseError as exc:
                raise ValueError(f"{key}={value!r}: {exc}") from None
        elif isinstance(var.default, bool):
            value = bool(value)
        elif isinstance(var.default, (int, float)) or var.field == "headroom_mb":
            try:
                value = var.parse(str(value))
            except ParseError as exc:
                raise ValueError(f"{key}={value!r}: {exc}") from None
        values[key] = value
    return Settings(**values)


def env_value(name: str) -> str | None:
    """Raw value of one of our variables (for `doctor`)."""
    if name not in BY_NAME:
        raise KeyError(name)
    return os.environ.get(name)


def flashinfer_confidential_compute_override() -> str | None:
    """FlashInfer's own CC override variable, read here so no other module reads the env."""
    return os.environ.get("FLASHINFER_CONFIDENTIAL_COMPUTE")


# Not a setting: ``demo`` puts its own pid here for the ranks it starts, and ``_demo-rank``
# runs only when this names its parent (a hand-run one would join a torchrun job's rendezvous).
DEMO_PARENT = f"{PREFIX}_DEMO_PARENT"


def demo_parent() -> str | None:
    """The pid ``demo`` gave the rank it started (``DEMO_PARENT``), as text; None unset."""
    return os.environ.get(DEMO_PARENT)


def rendezvous() -> tuple[str | None, str | None]:
    """torch's MASTER_ADDR and MASTER_PORT, read here so no other module reads the env
    (the demo gives them to each rank it starts; ``_demo-rank`` needs them)."""
    return os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")


_current: Settings | None = None
_current_lock = threading.Lock()


def current() -> Settings:
    """The process-wide Settings, read once (``reload`` re-reads them)."""
    global _current
    if _current is None:
        with _current_lock:
            if _current is None:
                _current = read_settings()
    return _current


def reload(**overrides: Any) -> Settings:
    global _current
    with _current_lock:
        _current = read_settings(**overrides)
    return _current
