"""An explicit-state checker over the model (``system``): breadth-first over every
interleaving of a small scenario, with *always* properties checked on every state reached
and *sometimes* properties that some state must reach (so that the search cannot skip a
branch silently: the vocabulary of Antithesis and Stateright).

Always:

- ``agreement``: no round is created on one rank and vetoed by the register on another
  (a rank in doubt is counted below, not here);
- ``valid``: a round is created only where every rank's call at that position says yes,
  to one and the same call;
- ``doubt only when the store stopped``: a rank answers "in doubt" only in a history
  where the store stopped answering, and never after it had read the register;
- ``bounded``: every answer comes within T + grace of the call's start, or within the
  grace of the rank's resumption when it was paused;
- ``terminates``: in a state with no step left, every rank that did not crash has answered
  every call, and none has a connection left waiting in the store; and from every state
  some history ends (no cycle of steps that time cannot leave: a livelock, which urgency
  would otherwise hide, as the search only sees states it has not seen);
- ``clean-up``: in such a final state, a round that every rank answered (none crashed;
  from its cache too) while the store answered has left no key behind (where the store
  stopped, a request stuck on one connection may land after the round's deletion, sent on
  another), and a group whose
  last round every rank answered from its count's completer, or that every rank has left
  for a new group (in the same processes), has left none at all (its leftovers were swept);
- ``clean rounds are created``: in such a final state, a round where every rank said yes
  to the same call, all started within T of each other, none crashed or was paused in it
  and the store answered throughout, is created on every rank, whatever came before it.

Sometimes: ``commit``, ``abort by no``, ``abort by mismatch``, ``abort by timeout``, ``abort
by a peer's cached veto``, ``abort by an interrupt``, ``a late rank follows a decided
register``, ``in doubt`` (where the scenario can reach them).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from . import system as S

SOMETIMES = ("commit", "abort by no", "abort by mismatch", "abort by timeout",
             "abort by a peer's cached veto", "abort by an interrupt",
             "a late rank follows a decided register", "in doubt")


@dataclasses.dataclass
class Result:
    scenario: str
    states: int = 0
    finals: int = 0
    seconds: float = 0.0
    violations: list = dataclasses.field(default_factory=list)  # (property, trace)
    seen: set = dataclasses.field(default_factory=set)  # sometimes properties reached


def rounds(sc: S.Scenario, state: S.State) -> dict:
    """``{(group, position): {rank: Answer}}`` of the answers so far."""
    out: dict = collections.defaultdict(dict)
    for r, rank in enumerate(state.ranks):
        for a in rank.answers:
            out[(a.group, a.pos)][r] = a
    return out


def _call(sc: S.Scenario, r: int, group: int, pos: int):
    groups = sc.calls[r]
    if group < len(groups) and pos < len(groups[group]):
        return groups[group][pos]
    return None


def _clean_calls(calls) -> bool:
    return all(c is not None and c.yes and not c.skip for c in calls) and \
        len({c.ident for c in calls}) == 1


def always(sc: S.Scenario, state: S.State) -> list:
    """The always properties that a single state can break: their names."""
    bad = []
    for (g, p), answers in rounds(sc, state).items():
        got = {a.answer for a in answers.values()}
        if "commit" in got and "abort" in got:
            bad.append(f"agreement at {(g, p)}: {answers}")
        if "commit" in got and not _clean_calls([_call(sc, r, g, p) for r in range(sc.size)]):
            bad.append(f"valid at {(g, p)}: created over calls "
                       f"{[_call(sc, r, g, p) for r in range(sc.size)]}")
        for r, a in answers.items():
            if a.answer == "doubt" and not a.stopped:
                bad.append(f"doubt only when the store stopped: rank {r} at {(g, p)}")
            if a.answer == "doubt" and a.cause == "read":
                bad.append(f"doubt only without the register: rank {r} at {(g, p)} had read it")
            if not a.on_time:
                bad.append(f"bounded: rank {r} at {(g, p)} answered late")
    return bad


def final(sc: S.Scenario, state: S.State) -> list:
    """The properties of a state with no step left."""
    bad = []
    for r, rank in enumerate(state.ranks):
        if rank.status != "crashed" and not S.finished(sc, r, rank):
            bad.append(f"terminates: rank {r} is still in {rank.current} at {state.now}")
        if rank.status != "crashed" and rank.parked:
            bad.append(f"terminates: rank {r}'s line is left waiting in the store for "
                       f"{rank.wait[0][1].key}")
    if any(rank.status == "crashed" for rank in state.ranks):
        return bad
    keys = {k for k, _ in state.store}
    for (g, p), answers in rounds(sc, state).items():
        if len(answers) == sc.size and not any(a.stopped for a in answers.values()):
            left = sorted(k for k in keys if k.startswith(S.prefix(g, S.MEMBERS, p)))
            if left:
                bad.append(f"clean-up: {(g, p)} left {left}")
    for g in {g for g, _ in rounds(sc, state)}:
        lasts = [max((a for a in rank.answers if a.group == g), key=lambda a: a.pos,
                     default=None) for rank in state.ranks]
        later_group = not sc.fresh and all(rank.group > g for rank in state.ranks)
        stopped = any(a.stopped for rank in state.ranks for a in rank.answers if a.group == g)
        if not stopped and (later_group or all(a is not None and a.complete for a in lasts)):
            left = sorted(k for k in keys if k.startswith(f"fiws/{g}/"))
            if left:
                bad.append(f"clean-up: group {g} left {left}")
    for (g, p), answers in rounds(sc, state).items():
        if not _clean_calls([_call(sc, r, g, p) for r in range(sc.size)]):
            continue
        if len(answers) != sc.size or any(a.paused or a.stopped for a in answers.values()):
            continue
        starts = [a.start for a in answers.values()]
        if max(starts) >= min(starts) + sc.t:
            continue
        if {a.answer for a in answers.values()} != {"commit"}:
            bad.append(f"clean rounds are created: {(g, p)} answered {answers}")
    return bad


def sometimes(state: S.State) -> set:
    out = set()
    for rank in state.ranks:
        for a in rank.answers:
            if a.answer == "commit":
                out.add("commit")
            elif a.answer == "doubt":
                out.add("in doubt")
            elif a.answer == "abort" and a.cause in ("no", "mismatch", "timeout"):
                out.add(f"abort by {a.cause}")
            elif a.answer == "abort" and a.cause == "cached":
                out.add("abort by a peer's cached veto")
            elif a.answer == "abort" and a.cause == "interrupted":
                out.add("abort by an interrupt")
            if a.late and a.answer in ("commit", "abort"):
                out.add("a late rank follows a decided register")
    return out


def explore(sc: S.Scenario, limit: int = 2_000_000, key: Callable = S.key) -> Result:
    """Every state reachable from the scenario's start, breadth first."""
    t0 = time.perf_counter()
    res = Result(sc.name)
    start = S.initial(sc)
    parent: dict = {key(start): None}
    before: dict = collections.defaultdict(list)  # state -> the states with a step to it
    finals: list = []
    queue = collections.deque([start])
    while queue:
        state = queue.popleft()
        res.states += 1
        if res.states > limit:
            res.violations.append(("limit", f"more than {limit} states"))
            break
        bad = always(sc, state)
        res.seen |= sometimes(state)
        nexts = S.successors(sc, state)
        here = key(state)
        if not nexts:
            res.finals += 1
            finals.append(here)
            bad += final(sc, state)
        if bad:
            res.violations.append((bad[0], _trace(parent, key, state)))
            break
        for action, nxt in nexts:
            k = key(nxt)
            before[k].append(here)
            if k in parent:
                continue
            parent[k] = (here, action)
            queue.append(nxt)
    if not res.violations:
        stuck = _stuck(parent, before, finals)
        if stuck is not None:
            res.violations.append(("terminates: a cycle no history leaves (a livelock: time "
                                   "never advances)", _trace_key(parent, stuck)))
    res.seconds = time.perf_counter() - t0
    return res


def _stuck(parent: dict, before: dict, finals: list):
    """A state from which no final state can be reached (every history from it runs in a
    cycle of steps, with time frozen by urgency), or None: backwards from the finals."""
    reach, queue = set(finals), collections.deque(finals)
    while queue:
        for k in before.get(queue.popleft(), ()):
            if k not in reach:
                reach.add(k)
                queue.append(k)
    return next((k for k in parent if k not in reach), None)


def _trace_key(parent: dict, k) -> list:
    out = []
    while parent.get(k) is not None:
        k, action = parent[k]
        out.append(action)
    return out[::-1]


def _trace(parent: dict, key: Callable, state: S.State) -> list:
    """The actions from the start to ``state``."""
    out, k = [], key(state)
    while parent.get(k) is not None:
        k, action = parent[k]
        out.append(action)
    return out[::-1]
