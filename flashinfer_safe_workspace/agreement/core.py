"""One rank's decision of one round, with no I/O: events in, store operations out.

A round is the i-th creation call on one rank set of one default group (``positions``),
the same i on every rank whatever call each rank makes. Its keys, under the prefix
``fiws/<generation>/<ranks>/<i>/``:

=====  =================================================================================
``r``  every rank's record, one line each (``append``: one-way, ordered before its add)
``n``  the count of yes: a rank that says yes adds 1 (a rank that says no adds nothing)
``d``  the register: written once with ``compare_set(d, "", value)``; the first write wins
       and every rank answers with what it holds
``o``  the count-out: each rank adds 1 once it has its answer; the add that reaches the
       size deletes the round's keys (every rank has read the register by then)
=====  =================================================================================

A yes rank appends its record and adds 1 (one round trip). The add that completes the
count (every rank said yes: a no never adds) reads every record (one) and writes the
register (one): commit only if every record is a yes to this very call, else an abort
naming why. Every other yes rank waits for the register (one) and reads it (one). A no
rank appends and writes its abort at once (one). At its deadline a rank still without an
answer writes an abort (one); whichever write came first is every rank's answer. A rank
whose last write is not answered by its deadline plus the grace is in doubt: it vetoes.

:class:`Core` holds one rank's state and is immutable: each event returns the next core
and the operations to run, so the production driver (``driver``) and the explicit-state
checker (``tests/model``) run the very same transitions. It reads no clock (the time
comes with each event), starts no thread and imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

COMMIT, PASS, ABORT = "commit", "pass", "abort"  # a register's outcomes (``Codec.outcome``)
DOUBT = "doubt"  # this rank's answer when its last write was not answered in time

# phases of one rank's decision
NEW, COUNT, READ, WRITE, WAIT, FETCH, DONE = "new", "count", "read", "write", "wait", "fetch", "done"
# what a reply answers (``Op.tag``)
T_COUNT, T_READ, T_WRITE, T_WAIT, T_FETCH, T_ABORT, T_OUT = (
    "count", "read", "write", "wait", "fetch", "abort", "out")
KEYS = ("r", "n", "d", "o")  # a round's keys, in the order the last rank out deletes them


@dataclasses.dataclass(frozen=True)
class Op:
    """One store operation. ``kind``: ``append`` (one-way, no reply), ``add`` (the new
    count), ``cas`` (``compare_set(key, "", value)``: the value the key holds afterwards),
    ``get`` (the value, or None when the key is missing: a ``compare_set`` read, never a
    blocking one; it wakes the key's waiters), ``check`` (whether the key exists; wakes
    nobody), ``wait`` (returns once the key may exist: also when someone reads it
    missing), ``delete``. ``line``: ``wait``, the rank set's own connection, for the round's
    operations in the order the core emits them (its blocking wait among them); ``main``,
    another connection, for the abort at a deadline or an interrupt, which must not queue
    behind that wait."""

    kind: str
    key: str
    value: str = ""  # append: the text; cas: the desired value
    n: int = 0  # add
    tag: str = ""  # what the reply answers ("": nothing waits for it)
    line: str = "wait"


@dataclasses.dataclass(frozen=True)
class Codec:
    """What the core needs to know of the values, as pure functions (the production one
    is ``vote.codec_for``'s; the checker has a small one of its own).

    ``verdict(payloads)``: the register text for a round where every record says yes to
    one call (commit, pass, or an abort by a cross-rank check); ``refuse(payloads, why)``:
    an abort's text for a round that cannot commit; ``outcome(text)``: COMMIT, PASS or
    ABORT (an unreadable text is an ABORT); ``complete(text)``: whether the text was
    written by the rank that completed the count (``verdict``'s and ``refuse``'s are)."""

    verdict: Callable[[list], str]
    refuse: Callable[[list, str], str]
    outcome: Callable[[str], str]
    complete: Callable[[str], bool]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one rank's decision is made of, fixed for its life."""

    prefix: str  # "fiws/<generation>/<ranks>/<position>/"
    size: int  # ranks in the set
    me: int  # this rank's position in the set
    yes: bool  # this rank's own answer
    call: str  # the call's identity: every rank of a commit has the same
    payload: str  # this rank's record as text (no newline, no tab)
    deadline: float  # when this rank writes its own abort (seconds, the driver's clock)
    grace: float  # how long after the deadline its last write may take
    texts: tuple  # the abort texts of (this rank's no, its deadline, an interrupt)
    codec: Codec

    def key(self, name: str) -> str:
        return self.prefix + name

    def line(self) -> str:
        return f"{self.me} {'y' if self.yes else 'n'} {self.call}\t{self.payload}\n"


@dataclasses.dataclass(frozen=True)
class Core:
    """One rank's decision of one round (immutable; every event returns the next one)."""

    setup: Setup
    phase: str = NEW
    aborting: bool = False  # this rank's own abort (deadline, interrupt) is on its way
    abort_at: float = 0.0  # when it went: its answer is due by then plus the grace
    register: Optional[str] = None  # what the register held when this rank learned it
    answer: Optional[str] = None  # COMMIT, PASS, ABORT or DOUBT, once decided
    decider: bool = False  # this rank's own write is what the register holds
    proposed: tuple = ()  # the register texts this rank wrote (the first write wins)
    out: int = 0  # the count-out this rank's add read (below the size: a rank is missing)
    spurious: bool = False  # a wake-up found no register: the next read looks first
    read: Optional[str] = None  # the register read while this rank's own abort was unanswered

    # -- events

    def start(self) -> tuple:
        """This rank arrives: its record, and its count (yes) or its abort (no)."""
        s = self.setup
        if self.phase != NEW:
            return self, []
        append = Op("append", s.key("r"), s.line())
        if s.yes:
            return self._to(COUNT), [append, Op("add", s.key("n"), n=1, tag=T_COUNT)]
        core, ops = self._write(s.texts[0])
        return core, [append, *ops]

    def skip(self) -> tuple:
        """This rank answers its call without a round (from its veto cache): it never
        publishes here, so its abort goes in at once (its peers learn it at once, and a
        peer that did not cache the veto follows it), and it counts out."""
        if self.phase != NEW:
            return self, []
        text = self.setup.texts[0]
        return (self._to(DONE, answer=ABORT, register=text, decider=True, proposed=(text,)),
                [Op("cas", self.setup.key("d"), text), self._out()])

    def on_reply(self, tag: str, value) -> tuple:
        """The reply of the operation tagged ``tag``; after the answer only the count-out's
        reply matters (the rank that completes it deletes the round's keys)."""
        if self.answer is not None:
            if tag != T_OUT:
                return self, []
            core = self._with(out=int(value))
            if core.out >= self.setup.size:  # every rank has its answer: nobody reads them again
                return core, [Op("delete", self.setup.key(k)) for k in KEYS]
            return core, []
        if tag == T_ABORT:  # its own abort's reply: what the register holds, for certain
            return self._decided(value)
        handler = _HANDLERS.get((self.phase, tag))
        if handler is None:
            return self, []
        if self.aborting and tag in (T_WRITE, T_FETCH) and value is not None and \
                value is not False and value is not True:
            # the register, read before this rank's own abort is answered: kept, and the
            # answer waits for the abort's reply (its count-out must not pass the abort)
            return self._with(read=_text(value)), []
        return handler(self, value)

    def on_tick(self, now: float) -> tuple:
        """Time passed: at its deadline this rank writes its own abort (a rank stopped past
        its deadline writes it when it runs again); its answer is due the grace after
        that, and without one it is in doubt."""
        s = self.setup
        if self.answer is not None or self.phase == NEW:
            return self, []
        if self.aborting and now >= self.abort_at + s.grace:
            if self.read is not None:  # its abort unanswered, the register read before
                return self._decided(self.read)
            return self._to(DONE, answer=DOUBT), [self._out()]  # the count-out lands if
            # the store answers again
        if now >= s.deadline and not self.aborting:
            return self._abort(s.texts[1], now)
        return self, []

    def on_resume(self, now: float, lost: float) -> tuple:
        """This process ran nothing for ``lost`` seconds (stopped, frozen, starved) and runs
        again at ``now``. The time it lost was not the store's to answer in: an abort of its
        own that it had not sent yet, or whose reply is waiting to be read, is due that much
        later (else it would be in doubt of a register the store holds, with a reply on its
        way: a veto beside its peers' commit), never later than the grace after ``now``. Only
        the lost time moves it: the time this rank ran still counts, so a process starved
        again and again still answers after a grace of its own running time."""
        if self.answer is not None or not self.aborting or lost <= 0 or now <= self.abort_at:
            return self, []
        return self._with(abort_at=min(self.abort_at + lost, now)), []

    def on_error(self) -> tuple:
        """The store failed this rank's own abort (its connection broke): the register it
        read already, if any, is its answer; else it is in doubt."""
        if self.answer is not None:
            return self, []
        if self.read is not None:
            return self._decided(self.read)
        return self._to(DONE, answer=DOUBT), [self._out()]

    def on_interrupt(self, now: float) -> tuple:
        """Ctrl-C or an error of ours mid-round: write the abort (the caller does not wait
        for the answer)."""
        if self.answer is not None or self.aborting:
            return self, []
        return self._abort(self.setup.texts[2], now)

    def wake_at(self) -> Optional[float]:
        """When ``on_tick`` must next be called (None: decided)."""
        if self.answer is not None or self.phase == NEW:
            return None
        return self.abort_at + self.setup.grace if self.aborting else self.setup.deadline

    # -- transitions

    def _to(self, phase: str, **changes) -> "Core":
        return self._with(phase=phase, **changes)

    def _with(self, **changes) -> "Core":
        """A copy with ``changes`` (``dataclasses.replace`` without re-running
        ``__init__``: a decision makes a handful of these on every rank)."""
        new = object.__new__(Core)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def _abort(self, text: str, now: float) -> tuple:
        return (self._with(aborting=True, abort_at=now, proposed=self.proposed + (text,)),
                [Op("cas", self.setup.key("d"), text, tag=T_ABORT, line="main")])

    def _counted(self, c) -> tuple:
        s = self.setup
        if int(c) == s.size:  # every rank said yes, this one last: decide
            return self._to(READ), [Op("get", s.key("r"), tag=T_READ)]
        return self._to(WAIT), [Op("wait", s.key("d"), tag=T_WAIT)]

    def _read(self, blob) -> tuple:
        """Every rank's yes is in (each appended its record before it added): commit only
        if there is one record per position and every one is for this very call (a round
        removed as a leftover under a late rank's feet holds fewer)."""
        s = self.setup
        heads, payloads = _parse(blob)
        payloads = [p for _, p in sorted(zip([h[0] for h in heads], payloads),
                                         key=lambda pair: pair[0])]
        if sorted(pos for pos, _ in heads) != list(range(s.size)):
            text = s.codec.refuse(payloads, f"the round holds {len(heads)} records for "
                                  f"{s.size} ranks")
        elif any(call != s.call for _, call in heads):
            text = s.codec.refuse(payloads, "ranks called with different arguments")
        else:
            text = s.codec.verdict(payloads)
        return self._write(text)

    def _write(self, text: str) -> tuple:
        return (self._to(WRITE, proposed=self.proposed + (text,)),
                [Op("cas", self.setup.key("d"), text, tag=T_WRITE)])

    def _woken(self, _value) -> tuple:
        """Woken: read the register. After a wake-up that found none, look first (``check``
        wakes nobody): a read of a missing key wakes its waiters, and two ranks woken for
        nothing would otherwise wake each other for as long as the register is missing."""
        if self.spurious:
            return self._to(FETCH), [Op("check", self.setup.key("d"), tag=T_FETCH)]
        return self._to(FETCH), [Op("get", self.setup.key("d"), tag=T_FETCH)]

    def _fetched(self, value) -> tuple:
        if value is None or value is False:  # woken by an outsider's read of the missing
            return self._to(WAIT, spurious=True), [  # register: wait on
                Op("wait", self.setup.key("d"), tag=T_WAIT)]
        if value is True:  # it is there now
            return self._to(FETCH, spurious=False), [
                Op("get", self.setup.key("d"), tag=T_FETCH)]
        return self._decided(value)

    def _decided(self, held) -> tuple:
        text = _text(held)
        outcome = self.setup.codec.outcome(text)
        if outcome != ABORT and not self.setup.yes:  # never reached (a commit needs every
            outcome = ABORT  # rank's yes); a rank that said no never creates
        return (self._to(DONE, register=text, answer=outcome, decider=text in self.proposed),
                [self._out()])

    def _out(self) -> Op:
        """The count-out, on the round's line behind its operations: the round's keys go
        only once every rank's wait for its register has returned (a wait left in the
        store for a deleted register would hold that line). This rank's answer came after
        its own abort's reply (``read``), except when that never came: in doubt, the
        abort may land after the deletion and leave the register behind."""
        return Op("add", self.setup.key("o"), n=1, tag=T_OUT)


_HANDLERS = {
    (COUNT, T_COUNT): Core._counted,
    (READ, T_READ): Core._read,
    (WRITE, T_WRITE): Core._decided,
    (WAIT, T_WAIT): Core._woken,
    (FETCH, T_FETCH): Core._fetched,
}


# -- leftovers. A round some rank never counted out of (it answered that call from its
# cache, crashed, or its calls were out of step with its peers') keeps its keys: its
# register may not go while a rank can still come to that position, for a late yes would
# find none and could write a commit its peers never saw. A rank that counted out short
# of the size, after an abort, remembers such a round. Once it answers a later round of
# the same rank set whose register the count's completer wrote, every rank had arrived
# there, so each has taken every earlier position and sent its count-outs of them: none
# comes back, and the remembered rounds' keys go. (A round every rank counts out of is
# deleted by its last rank out; a commit needs every rank's yes, so every rank counts out
# of it unless one dies.)


def leftover(core: "Core") -> bool:
    """Whether ``core``'s round may be left behind: counted out short, after an abort."""
    return 0 < core.out < core.setup.size and core.answer in (ABORT, DOUBT)


def sweep(later: "Core", leftovers: list) -> list:
    """The deletions of the remembered rounds (their prefixes), once ``later`` has an
    answer whose register the count's completer wrote; [] before."""
    if later.register is None or not later.setup.codec.complete(later.register):
        return []
    return forget(leftovers)


def forget(leftovers: list) -> list:
    """The deletions of rounds no rank comes back to (a later round was complete, or the
    default group was replaced: its ranks left it)."""
    return [Op("delete", prefix + k) for prefix in leftovers for k in KEYS]


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)


def _parse(blob) -> tuple:
    """``([(position, call)], [payload])`` of a round's record lines (the flag between
    them, ``y`` or ``n``, is for a person reading the store); a line that does not parse
    has position -1."""
    if isinstance(blob, (bytes, bytearray)):
        blob = bytes(blob).decode(errors="replace")
    heads, payloads = [], []
    for line in (blob or "").split("\n"):
        if not line:
            continue
        head, _, payload = line.partition("\t")
        parts = head.split(" ")
        ok = len(parts) == 3 and parts[0].isascii() and parts[0].isdigit()
        pos = int(parts[0]) if ok else -1
        heads.append((pos, parts[-1]))
        payloads.append(payload)
    return heads, payloads


def arrived(blob) -> set:
    """The positions whose record is in a round's records ``blob`` (its ``r`` key)."""
    heads, _ = _parse(blob)
    return {pos for pos, _ in heads if pos >= 0}
