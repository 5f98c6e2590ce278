"""What crosses the wire: a rank's record and a round's register.

Every value the agreement writes to the store (or hands to a comm backend's
``allgather``) is one of these dataclasses as JSON carrying the wire version. Nothing
else builds or reads those texts: a peer that runs another wire version, or a value that
does not parse, reads as :class:`Unreadable` (a "no" for a record, an ``abort`` for a
register), never as an exception in the round. A register's text starts with its outcome
and ``|`` (``commit|{...}``), so the core reads the outcome without parsing the rest.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Union

WIRE = 8  # bump on any change of the fields below or of the values a round writes

from .._reasons import OK, REASON_TEXT

# candidate states
YES, NO, PASS_STATE = "ok", "no", "pass"
# register outcomes
COMMIT, ABORT, PASS = "commit", "abort", "pass"


class Unreadable(ValueError):
    """A value in the store that is not a record of this wire version."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way this rank could create the workspace (``auto`` has two), and its answer."""

    state: str  # YES, NO or PASS_STATE (FlashInfer rejects the arguments itself)
    reason: int = OK
    note: str = ""
    plan_digest: str = ""
    peak_bytes: int = 0
    headroom_bytes: int = 0
    backend: str = ""
    device: int = -1
    free_bytes: int = -1
    failed_bytes: int = 0
    failed_headroom: bool = False  # the headroom, not a planned allocation, did not fit
    cuda_error: int = 0
    cuda_error_name: str = ""
    probe_ms: float = 0.0

    @property
    def usable(self) -> bool:
        return self.state in (YES, PASS_STATE)

    def text(self) -> str:
        label = REASON_TEXT.get(self.reason, "no")
        return f"{label}: {self.note}" if self.note and self.note != label else label


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One preflight check's answer on this rank (``checks/``): the fact it read, as text."""

    ok: bool = True
    code: int = OK
    value: str = ""  # the fact behind the answer, e.g. "multicast=0" (compared across ranks)
    note: str = ""  # why it failed, in words
    applies: bool = True  # False: this release/backend does not fail this way; not checked

    def text(self) -> str:
        label = REASON_TEXT.get(self.code, "no")
        return f"{label} ({self.value})" + (f": {self.note}" if self.note else "")


@dataclasses.dataclass(frozen=True)
class Record:
    """What one rank publishes for one decision (exactly one per rank per round)."""

    rank: Optional[int]  # global rank
    pid: int
    position: int  # index in the decision's rank set
    call: str  # the call's identity: every rank of one round must have the same
    args: dict  # the arguments behind the identity, for messages
    candidates: dict = dataclasses.field(default_factory=dict)  # name -> Candidate
    auto: bool = False  # FlashInfer's auto backend, resolved from every rank's records
    multicast: bool = False  # this rank supports multicast (auto's deciding fact)
    checks: dict = dataclasses.field(default_factory=dict)  # check name -> CheckResult
    proc: str = ""  # the writer's boot/pid-namespace/start (``process.identity``)
    at: float = 0.0  # when it was written (time.time(); ``process`` checks old ones)
    wire: int = WIRE

    def is_yes(self) -> bool:
        """Whether this record can still be part of a commit (or of an all-pass): such a
        rank waits for every record; any other rank decides abort at once."""
        if not self.candidates:
            return False
        usable = [c.usable for c in self.candidates.values()]
        return any(usable) if self.auto else all(usable)

    def failed_check(self) -> str:
        """The name of this rank's first failing check, or ``""``."""
        return next((name for name, c in self.checks.items() if not c.ok), "")

    def no_text(self) -> str:
        """This rank's reasons for its no, short (late ranks read it in the register)."""
        return "; ".join(c.text() for c in self.candidates.values())[:400] or "no"

    def to_json(self) -> str:
        body = _fields(self)  # a flat copy per level (``dataclasses.asdict`` deep-copies:
        body["candidates"] = {k: _fields(c) for k, c in self.candidates.items()}  # 10x slower)
        body["checks"] = {k: _fields(c) for k, c in self.checks.items()}
        return json.dumps(body, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, raw: Union[str, bytes]) -> "Record":
        body = _parse(raw, "record")
        try:
            cands = {str(k): _build(Candidate, v) for k, v in body.pop("candidates").items()}
            checks = {str(k): _build(CheckResult, v) for k, v in body.pop("checks", {}).items()}
            return cls(candidates=cands, checks=checks, **body)
        except (TypeError, AttributeError, KeyError) as exc:
            raise Unreadable(f"record: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Register:
    """A round's decision, written once with ``compare_set``: the first write wins. It
    carries the whole explanation of an abort, so every rank's veto names the same cause
    with the same words, whether it read the records or only this register."""

    outcome: str  # COMMIT, ABORT or PASS
    by: Optional[int] = None  # the rank whose write won
    why: str = ""
    check: str = ""  # the check that decided an abort ("" when none did)
    reasons: tuple = ()  # the deciding cause's reason codes (``_reasons``; () when unknown)
    details: tuple = ()  # the explanation, one text per rank or cause (``explain``)
    named: tuple = ()  # the ranks the explanation names
    short: tuple = ()  # (rank, device, bytes short) of each rank out of memory
    call: str = ""  # the call identity of the rank that wrote it
    complete: bool = False  # written by the rank that completed the count: every rank arrived
    wire: int = WIRE

    @property
    def commit(self) -> bool:
        return self.outcome == COMMIT

    def to_json(self) -> str:
        body = _fields(self)
        body["why"] = str(self.why)[:500]
        body["details"] = [str(d)[:600] for d in self.details[:16]]
        return json.dumps(body, sort_keys=True, default=str)

    def to_text(self) -> str:
        """The value a round's register holds: ``<outcome>|<json>``."""
        return f"{self.outcome}|{self.to_json()}"

    @classmethod
    def from_json(cls, raw: Union[str, bytes]) -> "Register":
        """An unreadable register reads as an abort: no rank commits on a value it cannot
        read (an earlier wire version, a foreign key)."""
        try:
            body = _parse(raw, "register")
            for name in ("reasons", "named"):
                body[name] = tuple(int(c) for c in body.get(name, ()))
            body["details"] = tuple(str(d) for d in body.get("details", ()))
            body["short"] = tuple(tuple(int(x) for x in entry) for entry in body.get("short", ()))
            reg = cls(**body)
        except (Unreadable, TypeError, ValueError, AttributeError) as exc:
            return cls(ABORT, why=f"unreadable register ({exc})")
        if reg.outcome not in (COMMIT, ABORT, PASS):
            return cls(ABORT, why=f"unreadable register outcome {reg.outcome!r}")
        return reg

    @classmethod
    def from_text(cls, raw: Union[str, bytes]) -> "Register":
        """A register's value (``to_text``); an unreadable one reads as an abort. The same
        text is read several times per decision (its outcome, whether the count's completer
        wrote it, the answer): kept, for the last few texts."""
        text = _text(raw)
        found = _READ.get(text)
        if found is None:
            found = cls._from_text(text)
            if len(_READ) >= 64:
                _READ.clear()
            _READ[text] = found
        return found

    @classmethod
    def _from_text(cls, text: str) -> "Register":
        head, sep, body = text.partition("|")
        reg = cls.from_json(body) if sep else cls(ABORT, why="unreadable register (no outcome)")
        if sep and reg.outcome != head:
            return cls(ABORT, why=f"unreadable register (outcome {head!r} against {reg.outcome!r})")
        return reg


_READ: dict = {}  # register text -> Register (``Register.from_text``)


def _text(raw) -> str:
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw).decode(errors="replace")
    return str(raw)


_NAMES: dict = {}  # dataclass -> its field names, in order
_SETS: dict = {}  # dataclass -> the same as a set


def _names(cls) -> tuple:
    found = _NAMES.get(cls)
    if found is None:
        found = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
        _SETS[cls] = frozenset(found)
    return found


def _fields(obj) -> dict:
    """A dataclass's own fields as a dict, one level (their values are plain here)."""
    found = obj.__dict__
    if len(found) == len(_names(type(obj))):  # a plain dataclass keeps its fields there
        return dict(found)
    return {name: getattr(obj, name) for name in _names(type(obj))}


def _build(cls, body):
    """``cls(**body)`` for a frozen dataclass of plain fields, without its ``__init__`` when
    ``body`` names exactly its fields (the wire's own texts do: every record is parsed by
    the rank that completes a round's count, 72 of them at 72 ranks)."""
    if isinstance(body, dict) and body.keys() == _SETS.get(cls) or (
            isinstance(body, dict) and _names(cls) and body.keys() == _SETS[cls]):
        obj = object.__new__(cls)
        obj.__dict__.update(body)
        return obj
    if not isinstance(body, dict):
        raise TypeError(f"{cls.__name__}: not an object")
    return cls(**body)


def _parse(raw, what: str) -> dict:
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode(errors="replace")
    try:
        body = json.loads(raw)
    except (TypeError, ValueError):
        raise Unreadable(f"{what}: not JSON") from None
    if not isinstance(body, dict):
        raise Unreadable(f"{what}: not an object")
    if body.get("wire") != WIRE:
        raise Unreadable(f"{what}: wire version {body.get('wire')!r}, expected {WIRE}")
    return body


def read_record(raw) -> Optional[Record]:
    """A record from the store, or None when it is unreadable (a "no" in the verdict)."""
    try:
        return Record.from_json(raw)
    except Unreadable:
        return None
