"""Seeded simulation of large groups over long histories: the checker's model
(``system``), the package's own ``Core``, one random interleaving per seed.

A seed fixes everything: the scenario (group size given; calls per rank, mismatches, noes,
cached vetoes, an extra call, a late rank, a new group) and the fault plan, FoundationDB's
two levels: each fault kind is first *activated* for the history or not, then *fired*
with a small probability at each step (a crash, a pause past the vote timeout with its
requests sent or not, the store stopped, an outsider's read that wakes the waiters, an
interrupt). The interleaving is drawn step by step
from the same generator, so a seed replays bit for bit: ``scripts/simulate --seed S
--ranks N`` prints its history. The checker's properties are checked at the end
(``checker.always``, ``checker.final``); a history that does not end within its step
budget is a violation too (``stuck``).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time

from . import checker as K
from . import system as S

A = "c"  # the call every rank makes unless the plan says otherwise


@dataclasses.dataclass
class Run:
    seed: int
    size: int
    calls: int = 0  # calls per rank (the most any rank has)
    steps: int = 0
    seconds: float = 0.0
    answers: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seen: set = dataclasses.field(default_factory=set)
    violations: list = dataclasses.field(default_factory=list)
    trace: list = dataclasses.field(default_factory=list)  # the last steps, for a replay


def scenario(seed: int, size: int, calls: tuple = (5, 25)) -> tuple:
    """``(Scenario, fault probabilities)`` for a seed: the same on every call."""
    rng = random.Random(seed * 7919 + size)
    n = rng.randint(*calls)
    per_rank = [[S.Call(f"{A}{i % 3}") for i in range(n)] for _ in range(size)]
    if rng.random() < 0.4:  # mismatched arguments at a few positions
        for _ in range(rng.randint(1, 3)):
            r, i = rng.randrange(size), rng.randrange(n)
            per_rank[r][i] = S.Call("other")
    if rng.random() < 0.5:  # a rank says no at a few positions
        for _ in range(rng.randint(1, 3)):
            r, i = rng.randrange(size), rng.randrange(n)
            per_rank[r][i] = per_rank[r][i]._replace(yes=False)
    if rng.random() < 0.3:  # a rank answers a call from its veto cache
        r, i = rng.randrange(size), rng.randrange(n)
        per_rank[r][i] = per_rank[r][i]._replace(skip=True)
    if rng.random() < 0.15:  # one rank makes one call more than its peers
        r = rng.randrange(size)
        per_rank[r].insert(rng.randrange(n), S.Call("extra"))
    groups = 2 if rng.random() < 0.15 else 1
    cut = n // 2
    calls_of = tuple(((tuple(c[:cut]), tuple(c[cut:])) if groups == 2 else (tuple(c),))
                     for c in per_rank)
    starts = tuple(3 if rng.random() < 0.05 else 0 for _ in range(size)) \
        if rng.random() < 0.3 else ()
    fire = {kind: (rng.choice((0.0005, 0.002, 0.01)) if rng.random() < 0.25 else 0.0)
            for kind in ("crash", "pause", "store", "peek", "interrupt")}
    sc = S.Scenario(
        f"seed {seed}", size, calls_of, starts=starts,
        crash=rng.randint(1, 2) if fire["crash"] else 0,
        pause=rng.randint(1, 3) if fire["pause"] else 0,
        stop=(1, 4) if fire["store"] else (),
        peek=rng.randint(1, 5) if fire["peek"] else 0,
        interrupt=rng.randint(1, 2) if fire["interrupt"] else 0,
        fresh=groups == 2 and rng.random() < 0.5,
        horizon=(n + 2) * (3 + 2) * groups + 40)
    return sc, fire


FAULT_OF = {"crash": "crash", "pause": "pause", "store": "store stops", "peek": "peek",
            "interrupt": "interrupt"}


def run(seed: int, size: int, calls: tuple = (5, 25), max_steps: int = 2_000_000,
        keep: int = 200) -> Run:
    """One history: the seed's scenario, faults and interleaving."""
    t0 = time.perf_counter()
    sc, fire = scenario(seed, size, calls)
    rng = random.Random(seed)
    out = Run(seed, size, max(len(g) for c in sc.calls for g in c))
    trace: collections.deque = collections.deque(maxlen=keep)
    state = S.initial(sc)
    while True:
        acts = S.actions(sc, state)
        steps = [a for a in acts if not _fault(a[0])]
        faults = [a for a in acts if _fault(a[0])]
        firing = [a for a in faults if rng.random() < fire[_fault(a[0])]]
        if firing:
            name, step = rng.choice(firing)
            out.faults[name.split(" ")[0]] += 1
        elif steps:
            name, step = rng.choice(steps)
        else:
            break
        state = step()
        trace.append(f"t={state.now} {name}")
        out.steps += 1
        if out.steps >= max_steps:
            out.violations.append(f"stuck: no end after {max_steps} steps")
            break
    out.violations += K.always(sc, state) + K.final(sc, state)
    out.seen = K.sometimes(state)
    for rank in state.ranks:
        for a in rank.answers:
            out.answers[a.answer if a.answer != "abort" else f"abort by {a.cause}"] += 1
    out.trace = list(trace)
    out.seconds = time.perf_counter() - t0
    return out


def _fault(name: str):
    for kind, prefix in FAULT_OF.items():
        if name.startswith(prefix):
            return kind
    return None
