"""The agreement as a transition system: ranks running the package's ``Core``, the c10d
store, time, and faults. A state is a tuple (hashable); ``successors(state)`` lists every
next state with the action's name.

The store does what torch's TCPStore (libuv server, torch 2.11-2.13) does for the
operations the core uses (docs/agreement.md, "The store"):

- ``append`` is one-way: the next request on the same connection implies it was applied;
- ``add`` returns the new count; ``compare_set`` returns the value held afterwards, stores
  ``desired`` on a missing key only when ``expected`` is empty, and returns ``expected``
  (storing nothing) for a missing key otherwise; the core's ``get`` is that
  ``compare_set(key, ABSENT, ABSENT)``, so reading a missing key returns nothing;
- ``append``, ``add`` and ``compare_set`` (every branch, the missing-key read too) wake
  every client waiting on the key; ``delete`` wakes none; a ``wait`` on a present key
  returns at once;
- each connection's requests are served in order, one request at a time store-wide.

A rank has two connections, as in production: ``main`` and ``wait`` (the blocking wait
and the read after it). A request is served when the store takes it, and its reply is
handed to the rank's core in the same step (a paused rank finds it on resume). A paused
rank either had its requests on the wire (the store serves them while it is paused) or had
not sent them yet ("held": nothing of it is served before it resumes); on resuming it tells
its core (``Core.on_resume``), as the driver does when a slice of its wait took far longer
than asked. A crashed
rank's requests already on the wire are still served (the bytes are in the socket); what
it had queued behind a request awaiting its reply is lost with it.

Time is a whole number of units. Nothing takes time but waiting: a step that can happen
now (a start, a served request, a deadline reached) happens before time advances
("urgency"), so a rank or a store that is slow is a fault chosen on purpose: a late
arrival, a paused rank, a stopped store.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from flashinfer_safe_workspace.agreement import core as C
from flashinfer_safe_workspace.agreement.positions import prefix  # noqa: F401 - the checker's too

ABSENT = object()
MEMBERS = "set"  # the rank set's key in the round's prefix (one set per model)


# --------------------------------------------------------------------------- the codec

def _verdict(payloads) -> str:
    return "commit"


def _refuse(payloads, why) -> str:
    return "abort|" + (why or "refused")


def _outcome(text) -> str:
    head = text.split("|", 1)[0]
    return head if head in (C.COMMIT, C.PASS, C.ABORT) else C.ABORT


def _complete(text) -> bool:
    return text == "commit" or (text.startswith("abort|") and text.count("|") == 1)


CODEC = C.Codec(_verdict, _refuse, _outcome, _complete)


def texts(me: int) -> tuple:
    return (f"abort|no|{me}", f"abort|timeout|{me}", f"abort|interrupted|{me}")


def cause(register: Optional[str]) -> str:
    """What decided a register text of this codec."""
    if register is None:
        return "-"
    if register == "commit":
        return "commit"
    parts = register.split("|")
    if parts[1] == "no" or parts[1] == "a rank said no":
        return "no"
    if parts[1] == "timeout":
        return "timeout"
    if parts[1] == "ranks called with different arguments":
        return "mismatch"
    return parts[1]


# --------------------------------------------------------------------------- scenario

class Call(NamedTuple):
    ident: str  # the call's identity (equal ranks' calls pair)
    yes: bool = True
    skip: bool = False  # answered without a round (a cached veto, a pass-through)


class Scenario(NamedTuple):
    name: str
    size: int
    calls: tuple  # per rank: per group: tuple of Call
    t: int = 2  # the vote timeout
    grace: int = 1
    starts: tuple = ()  # per rank: the earliest time of its first call (a late arrival)
    crash: int = 0  # ranks that may crash, at any step
    peek: int = 0  # reads of a missing register by an outsider (each wakes its waiters)
    fresh: bool = False  # each new group's ranks are new processes: they remember nothing
    pause: int = 0  # ranks that may be paused past the vote timeout
    stop: tuple = ()  # how long the store may stop (each a choice), once
    horizon: int = 40
    interrupt: int = 0  # ranks that may be interrupted mid-round (Ctrl-C, an error of ours)


class Rank(NamedTuple):
    status: str  # "live" | "paused" | "held" (paused before sending) | "crashed"
    resume_at: int
    group: int  # index of its current group
    started: int  # calls started in that group (the next one's position)
    current: Optional[tuple]  # (group, position) of the call it is answering, or None
    cores: tuple  # ((group, position), Core) of calls whose requests are not all served
    main: tuple  # ((group, position), Op) requests on the main connection, oldest first
    wait: tuple  # the same on the waiting connection
    parked: bool  # the waiting connection's head waits in the store
    inbox: tuple  # replies a paused rank has not seen yet: (owner, tag, value)
    start: int  # when its current call started
    late: bool  # its current round was decided when its record arrived
    resumed: int  # when it was last resumed during its current call (-1: never paused)
    answers: tuple  # Answer of each call answered
    leftovers: tuple  # (group, position) of rounds it left behind (``core.leftover``)


class Answer(NamedTuple):
    """One rank's answer to one call, with what the properties need of its history."""

    group: int
    pos: int
    answer: str  # commit, pass, abort, doubt, or skip (answered without a round)
    cause: str  # what decided the register (``cause``)
    start: int
    late: bool  # its round was decided when its record arrived
    paused: bool  # the rank was paused during the call
    stopped: bool  # the store stopped between the call's start and its answer
    on_time: bool  # answered within T + grace of its start (or the grace of its resumption)
    complete: bool  # its register was written by the rank that completed the count


class State(NamedTuple):
    now: int
    store: tuple  # sorted (key, value)
    parked: tuple  # (rank, key) waits parked in the store
    ranks: tuple
    stopped_until: int  # the store serves nothing before this time (-1: it is up)
    crash: int  # faults left
    pause: int
    peek: int
    window: tuple  # (from, until) of the store's stop, once it has stopped; () before
    interrupt: int = 0


def initial(sc: Scenario) -> State:
    ranks = tuple(Rank("live", 0, 0, 0, None, (), (), (), False, (), 0, False, -1, (), ())
                  for _ in range(sc.size))
    return State(0, (), (), ranks, -1, sc.crash, sc.pause, sc.peek, (), sc.interrupt)


# --------------------------------------------------------------------------- helpers

def _set(state: State, r: int, rank: Rank) -> State:
    ranks = list(state.ranks)
    ranks[r] = rank
    return state._replace(ranks=tuple(ranks))


def _calls_of(sc: Scenario, r: int, group: int) -> tuple:
    groups = sc.calls[r]
    return groups[group] if group < len(groups) else ()


def finished(sc: Scenario, r: int, rank: Rank) -> bool:
    """Whether the rank has answered every call of its scenario."""
    return rank.current is None and _next(sc, r, rank) is None


def _core(rank: Rank, owner) -> Optional[C.Core]:
    for key, core in rank.cores:
        if key == owner:
            return core
    return None


def _put(sc: Scenario, state: State, r: int, owner, core: C.Core, ops) -> State:
    """Rank ``r`` with ``owner``'s core replaced and ``ops`` queued on their lines; its
    answer recorded once the core has one."""
    rank = state.ranks[r]
    main, wait = list(rank.main), list(rank.wait)
    for op in ops:
        (wait if op.line == "wait" else main).append((owner, op))
    before = _core(rank, owner)
    cores = tuple((k, core if k == owner else c) for k, c in rank.cores)
    if owner not in [k for k, _ in cores]:
        cores += ((owner, core),)
    if before is not None and not C.leftover(before) and C.leftover(core):
        rank = rank._replace(leftovers=rank.leftovers + (owner,))
    rank = rank._replace(main=tuple(main), wait=tuple(wait), cores=cores)
    if rank.current == owner and core.answer is not None:  # answered: recorded once
        older = [k for k in rank.leftovers if k[0] == owner[0] and k[1] < owner[1]]
        gone = C.sweep(core, [prefix(g, MEMBERS, p) for g, p in older])
        if gone:  # every rank arrived here: the older leftovers' keys go
            main = main + [(owner, op) for op in gone]
            rank = rank._replace(main=tuple(main),
                                 leftovers=tuple(k for k in rank.leftovers if k not in older))
        now, window = state.now, state.window
        due = (rank.resumed if rank.resumed >= 0 else rank.start + sc.t) + sc.grace
        rank = rank._replace(current=None, answers=rank.answers + (Answer(
            owner[0], owner[1], core.answer,
            ("read" if core.read is not None else "-") if core.answer == C.DOUBT
            else cause(core.register), rank.start, rank.late,
            rank.resumed >= 0, bool(window) and window[0] <= now and window[1] >= rank.start,
            now <= max(due, rank.start + sc.t + sc.grace),
            core.register is not None and CODEC.complete(core.register)),))
    return _set(state, r, _retire(rank))


def _eager(sc: Scenario, state: State, r: int) -> State:
    """Serve a rank's count-out requests as soon as they reach the head of one of its
    connections (a partial-order reduction: the count-out touches only its own key, and the
    keys it deletes are deleted once every rank of the round has answered, when no rank
    reads them again, so serving it at once or later reaches the same answers)."""
    while True:
        rank = state.ranks[r]
        if state.stopped_until >= 0 or rank.status == "held":
            return state
        for line, fifo in (("main", rank.main), ("wait", rank.wait)):
            if fifo and not (line == "wait" and rank.parked) and (
                    fifo[0][1].tag == C.T_OUT or fifo[0][1].kind == "delete"):
                state = _serve(sc, state, r, line)
                break
        else:
            return state


def key(state: State) -> tuple:
    """A state's identity for the search: the cores reduced to what decides their next
    steps (their setup follows from the scenario, the owner and the start time)."""
    return (state.now, state.store, state.parked, state.stopped_until, state.crash, state.pause,
            state.peek, state.window, state.interrupt, tuple((rk.status, rk.resume_at, rk.group, rk.started, rk.current,
                                 tuple((o, c.phase, c.aborting, c.abort_at, c.register, c.answer,
                                        c.out) for o, c in rk.cores),
                                 rk.main, rk.wait, rk.parked, rk.inbox,
                                 rk.start if rk.current else -1, rk.late, rk.resumed,
                                 rk.answers, rk.leftovers) for rk in state.ranks))


def _retire(rank: Rank) -> Rank:
    """Forget the cores of answered calls whose requests are all served."""
    busy = ({k for k, _ in rank.main} | {k for k, _ in rank.wait}
            | {k for k, _, _ in rank.inbox})  # a reply still to be read: its core stays
    keep = tuple((k, c) for k, c in rank.cores if k == rank.current or k in busy)
    return rank if keep == rank.cores else rank._replace(cores=keep)


def _feed(sc: Scenario, state: State, r: int, owner, tag: str, value) -> State:
    """Hand a reply to rank ``r``'s core of ``owner`` (or its inbox while paused; nothing
    if crashed or that core is gone)."""
    rank = state.ranks[r]
    if rank.status == "crashed":
        return state
    if rank.status in ("paused", "held"):
        return _set(state, r, rank._replace(inbox=rank.inbox + ((owner, tag, value),)))
    core = _core(rank, owner)
    if core is None:
        return state
    core, ops = core.on_reply(tag, value)
    return _eager(sc, _put(sc, state, r, owner, core, ops), r)


# --------------------------------------------------------------------------- the store

def _serve(sc: Scenario, state: State, r: int, line: str) -> State:
    rank = state.ranks[r]
    fifo = rank.wait if line == "wait" else rank.main
    owner, op = fifo[0]
    store = dict(state.store)
    rank = rank._replace(**{line: fifo[1:]})
    if op.kind == "append" and owner == rank.current and op.key[:-1] + "d" in store:
        rank = rank._replace(late=True)  # its round was decided before its record came
    reply, woke = ABSENT, False
    if op.kind == "append":
        store[op.key] = store.get(op.key, "") + op.value
        woke = True
    elif op.kind == "add":
        reply = int(store.get(op.key, "0")) + op.n
        store[op.key] = str(reply)
        woke = True
    elif op.kind == "cas":  # compare_set(key, "", value): stores only on a missing key
        if op.key in store:
            if store[op.key] == "":
                store[op.key] = op.value
            reply = store[op.key]
        else:
            store[op.key] = reply = op.value
        woke = True
    elif op.kind == "get":
        reply = store.get(op.key)  # compare_set(key, ABSENT, ABSENT): nothing stored
        woke = True
    elif op.kind == "wait":
        if op.key not in store:  # parked: the connection waits in the store
            state = _set(state, r, rank._replace(wait=fifo, parked=True))
            return state._replace(parked=tuple(sorted(state.parked + ((r, op.key),))))
        reply = None
    elif op.kind == "check":
        reply = op.key in store
    elif op.kind == "delete":
        store.pop(op.key, None)
    else:  # pragma: no cover - the core emits no other kind
        raise AssertionError(op.kind)
    state = _set(state, r, rank)._replace(store=tuple(sorted(store.items())))
    if reply is not ABSENT and op.tag:
        state = _feed(sc, state, r, owner, op.tag, reply)
    state = _set(state, r, _retire(state.ranks[r]))
    if woke:
        state = _wake(sc, state, op.key)
    return _eager(sc, state, r)


def _wake(sc: Scenario, state: State, key: str) -> State:
    waking = [r for r, k in state.parked if k == key]
    if not waking:
        return state
    state = state._replace(parked=tuple(p for p in state.parked if p[1] != key))
    for r in waking:
        rank = state.ranks[r]
        owner, op = rank.wait[0]
        state = _set(state, r, rank._replace(wait=rank.wait[1:], parked=False))
        state = _feed(sc, state, r, owner, op.tag, None)
        state = _set(state, r, _retire(state.ranks[r]))
    return state


# --------------------------------------------------------------------------- steps

def _next(sc: Scenario, r: int, rank: Rank) -> Optional[tuple]:
    """(group, position) of the rank's next call, or None when it has made them all."""
    group, pos = rank.group, rank.started
    while group < len(sc.calls[r]) and pos >= len(_calls_of(sc, r, group)):
        group, pos = group + 1, 0
    return (group, pos) if group < len(sc.calls[r]) else None


def _may_start(sc: Scenario, state: State, r: int) -> Optional[tuple]:
    rank = state.ranks[r]
    if rank.status != "live" or rank.current is not None:
        return None
    nxt = _next(sc, r, rank)
    if nxt is None:
        return None
    if nxt == (0, 0) and sc.starts and state.now < sc.starts[r]:
        return None  # a late arrival
    if nxt[0] > 0 and nxt[1] == 0:  # a new group: every rank has left the old one
        if not all(o.status == "crashed" or _left(sc, i, o, nxt[0])
                   for i, o in enumerate(state.ranks)):
            return None
    return nxt


def _left(sc: Scenario, r: int, rank: Rank, group: int) -> bool:
    """Whether the rank is done with every group before ``group``."""
    if rank.current is not None:
        return rank.current[0] >= group
    nxt = _next(sc, r, rank)
    return nxt is None or nxt[0] >= group


def _start(sc: Scenario, state: State, r: int, owner: tuple) -> State:
    rank = state.ranks[r]
    call = _calls_of(sc, r, owner[0])[owner[1]]
    setup = C.Setup(prefix(owner[0], MEMBERS, owner[1]), sc.size, r, call.yes, call.ident,
                    call.ident, state.now + sc.t, sc.grace,
                    (f"abort|cached|{r}",) + texts(r)[1:] if call.skip else texts(r), CODEC)
    rank = rank._replace(group=owner[0], started=owner[1] + 1, start=state.now, late=False,
                         resumed=-1)
    if call.skip:  # answered from its cache: its abort posted, no round of its own
        core, ops = C.Core(setup).skip()
        state = _set(state, r, rank._replace(answers=rank.answers + (Answer(
            owner[0], owner[1], "skip", "cached", state.now, False, False, False, True, False),)))
        return _put(sc, state, r, owner, core, ops)
    core, ops = C.Core(setup).start()
    old = [k for k in rank.leftovers if k[0] < owner[0]]
    if old:  # a new group: every rank has left the old ones, whose leftovers go
        gone = [] if sc.fresh else C.forget([prefix(g, MEMBERS, p) for g, p in old])
        rank = rank._replace(leftovers=tuple(k for k in rank.leftovers if k not in old),
                             main=rank.main + tuple((owner, op) for op in gone))
    return _put(sc, _set(state, r, rank._replace(current=owner)), r, owner, core, ops)


def _tick(sc: Scenario, state: State, r: int) -> State:
    rank = state.ranks[r]
    core, ops = _core(rank, rank.current).on_tick(state.now)
    return _eager(sc, _put(sc, state, r, rank.current, core, ops), r)


def _resume(sc: Scenario, state: State, r: int) -> State:
    rank = state.ranks[r]
    cores = tuple((o, c.on_resume(state.now, sc.t + 1)[0]) for o, c in rank.cores)  # paused
    # for t + 1 (``_moves``)
    state = _set(state, r, rank._replace(status="live", resume_at=0, cores=cores,
                                         resumed=state.now))
    while state.ranks[r].inbox:  # one by one: a core with a reply still to read stays
        (owner, tag, value), rest = state.ranks[r].inbox[0], state.ranks[r].inbox[1:]
        state = _feed(sc, _set(state, r, state.ranks[r]._replace(inbox=rest)), r, owner, tag,
                      value)
    return state


def _crash(state: State, r: int, budget: str = "crash") -> State:
    """The process dies: requests on the wire are still served, the rest is lost."""
    rank = state.ranks[r]

    def on_wire(fifo):
        kept = []
        for item in fifo:
            kept.append(item)
            if item[1].tag:  # the first request that waits for its reply: nothing after it
                break
        return tuple(kept)
    rank = rank._replace(status="crashed", main=on_wire(rank.main), inbox=(), leftovers=(),
                         wait=rank.wait[:1] if rank.parked else on_wire(rank.wait))
    return _set(state, r, rank)._replace(**{budget: getattr(state, budget) - 1})


def _interrupt(sc: Scenario, state: State, r: int) -> State:
    """Ctrl-C (or an error of ours) mid-round: the driver hands the core the interrupt, its
    abort goes out on the main line, and the call raises without waiting for the answer;
    the process is taken to be gone with it (requests on the wire still served)."""
    rank = state.ranks[r]
    core, ops = _core(rank, rank.current).on_interrupt(state.now)
    state = _put(sc, state, r, rank.current, core, ops)
    return _crash(state, r, "interrupt")


def successors(sc: Scenario, state: State) -> list:
    """``[(action, next state)]``: every step possible now (a tick that changes nothing is
    no step). Steps that can happen now are urgent: time advances only when there is none."""
    out = []
    for name, step in actions(sc, state):
        nxt = step()
        if not (name.startswith("tick ") and nxt == state):
            out.append((name, nxt))
    return out


def actions(sc: Scenario, state: State) -> list:
    """``[(action, thunk)]``: every step possible now, each computed only when called (the
    simulator takes one of them)."""
    if state.stopped_until >= 0 and state.now >= state.stopped_until:
        def resumes(state=state):
            state = state._replace(stopped_until=-1)
            for r in range(len(state.ranks)):
                state = _eager(sc, state, r)
            return state
        return [("store resumes", resumes)]
    up = state.stopped_until < 0
    out = []
    for r, rank in enumerate(state.ranks):
        if rank.status in ("paused", "held") and state.now >= rank.resume_at:
            out.append((f"resume {r}", lambda r=r: _resume(sc, state, r)))
            continue
        owner = _may_start(sc, state, r)
        if owner is not None:
            out.append((f"start {r} {owner}", lambda r=r, o=owner: _start(sc, state, r, o)))
        if up and rank.status != "held":
            for line, fifo in (("main", rank.main), ("wait", rank.wait)):
                if fifo and not (line == "wait" and rank.parked):
                    out.append((f"serve {r} {line} {fifo[0][1].kind} {fifo[0][1].key}",
                                lambda r=r, line=line: _serve(sc, state, r, line)))
        if rank.status == "live" and rank.current is not None:
            wake = _core(rank, rank.current).wake_at()
            if wake is not None and state.now >= wake:
                out.append((f"tick {r}", lambda r=r: _tick(sc, state, r)))
    if not out and state.now < sc.horizon and _pending(sc, state):
        out.append(("time", lambda: state._replace(now=state.now + 1)))
    return out + _faults(sc, state)


def _pending(sc: Scenario, state: State) -> bool:
    """Whether anything is left to happen (time only passes towards it)."""
    return state.stopped_until >= 0 or any(
        rank.status in ("paused", "held") or rank.main or rank.wait
        or (rank.status == "live" and not finished(sc, r, rank))
        for r, rank in enumerate(state.ranks))


def _faults(sc: Scenario, state: State) -> list:
    """The steps that may come at any time, or never: the faults (as thunks)."""
    out = []
    for r, rank in enumerate(state.ranks):
        if state.crash and rank.status != "crashed" and not finished(sc, r, rank):
            out.append((f"crash {r}", lambda r=r: _crash(state, r)))
        if state.interrupt and rank.status == "live" and rank.current is not None:
            out.append((f"interrupt {r}", lambda r=r: _interrupt(sc, state, r)))
        if state.pause and rank.status == "live" and rank.current is not None:
            for how, status in (("", "paused"), (" before sending", "held")):
                out.append((f"pause {r}{how}", lambda r=r, rank=rank, status=status: _set(
                    state, r, rank._replace(status=status, resume_at=state.now + sc.t + 1))
                    ._replace(pause=state.pause - 1)))
    if state.peek and state.stopped_until < 0:  # an outsider's compare_set read of a register
        for key in sorted({k for _, k in state.parked}):  # someone waits for
            out.append((f"peek {key}",
                        lambda key=key: _wake(sc, state, key)._replace(peek=state.peek - 1)))
    if sc.stop and not state.window and _pending(sc, state):
        for length in sc.stop:
            out.append((f"store stops for {length}", lambda length=length: state._replace(
                stopped_until=state.now + length, window=(state.now, state.now + length))))
    return out
