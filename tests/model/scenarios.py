"""The scenarios the checker explores exhaustively (tests/unit/agreement/test_checker.py),
each with what it must be able to reach.

Two ranks with up to three calls each cover every fault class; three ranks cover them
again with one to three calls each, where a third rank changes what can interleave. Calls are named
by what every rank must share: ``A`` and ``B`` are different arguments (``B`` the one that
differs), ``N`` is a call of ``A``'s arguments whose rank says no (out of memory, a check),
``S`` is ``A`` answered from this rank's veto cache (no round of its own).
"""

from __future__ import annotations

from .system import Call, Scenario

A, B = Call("A"), Call("B")
N = Call("A", yes=False)
S = Call("A", skip=True)
C1000, C1024 = Call("max_token_num=1000"), Call("max_token_num=1024")


def _same(call_list, size):
    return ((tuple(call_list),),) * size


TWO = [
    Scenario("two ranks: every rank says yes, three calls", 2, _same([A, A, A], 2)),
    Scenario("two ranks: a no, then two clean calls", 2, (((N, A, A),), ((A, A, A),))),
    Scenario("two ranks: mismatched arguments, then two clean calls", 2,
             (((B, A, A),), ((A, A, A),))),
    Scenario("two ranks: rank 0 calls 1000 then 1024, rank 1 calls 1024 then 1024", 2,
             (((C1000, C1024),), ((C1024, C1024),))),
    Scenario("two ranks: rank 0 makes one call more than rank 1", 2,
             (((B, A, A),), ((A, A),))),
    Scenario("two ranks: rank 1 arrives after rank 0's deadline", 2, _same([A, A, A], 2),
             starts=(0, 3)),
    Scenario("two ranks: either crashes at any step", 2, _same([A, A, A], 2), crash=1),
    Scenario("two ranks: either is paused past the vote timeout", 2, _same([A, A, A], 2),
             pause=1),
    Scenario("two ranks: rank 1 arrives at rank 0's deadline, and either is paused (its "
             "requests sent or not)", 2, _same([A, A], 2), starts=(0, 2), pause=1),
    Scenario("two ranks: either is interrupted (Ctrl-C) mid-round", 2, _same([A, A], 2),
             interrupt=1),
    Scenario("two ranks: the store stops for less than the grace, or past every deadline", 2,
             _same([A, A, A], 2), stop=(1, 4)),
    Scenario("two ranks: rank 1 arrives at rank 0's deadline, and the store stops past it", 2,
             _same([A], 2), starts=(0, 2), stop=(4,)),
    Scenario("two ranks: rank 0 answers its first call from its veto cache", 2,
             (((S, A, A),), ((A, A, A),))),
    Scenario("two ranks: a new group on the same store after a round only rank 0 made", 2,
             (((A, A), (A, A)), ((A,), (A, A)))),
    Scenario("two ranks: a new group on the same store after a no, with a no", 2,
             (((N,), (N, A)), ((A,), (A, A)))),
    Scenario("two ranks: new processes form a new group on the same store after a round "
             "only rank 0 made", 2, (((A, A), (A, A)), ((A,), (A, A))), fresh=True),
    Scenario("two ranks: an outsider reads a missing register (a spurious wake-up)", 2,
             _same([A, A], 2), peek=1),
]

THREE = [
    Scenario("three ranks: every rank says yes, three calls", 3, _same([A, A, A], 3)),
    Scenario("three ranks: a no and a mismatch, then two clean calls", 3,
             (((N, A, A),), ((B, A, A),), ((A, A, A),))),
    Scenario("three ranks: rank 2 arrives after the others' deadlines", 3, _same([A, A], 3),
             starts=(0, 0, 3)),
    Scenario("three ranks: any one crashes at any step", 3, _same([A], 3), crash=1),
    Scenario("three ranks: any one is paused past the vote timeout", 3, _same([A], 3), pause=1),
    Scenario("three ranks: the store stops for less than the grace, or past every deadline", 3,
             _same([A], 3), stop=(1, 4)),
    Scenario("three ranks: rank 0 makes one call more, rank 1 answers from its cache", 3,
             (((B, A),), ((S, A),), ((A,),))),
]

SCENARIOS = TWO + THREE
