"""One rank's decision driven by hand: events into ``agreement.core.Core``, and the store
operations it returns asserted, row by row of docs/agreement.md's table. The checker
(test_checker.py) proves what the core decides over every interleaving of its model; these
tests pin what the model cannot show: the exact operations and lines, what the codec is
given, records that do not parse, events that come in an order the model's callers never
send (a tick after the answer, a tick inside the grace), and the rounds' positions on a
rank set (``positions.Group``), which only the package's decision path uses.

Nothing here waits on the clock: the core takes the time as an argument, and the one
``Group.turn`` test that waits is bounded and asserts an outcome, never a duration.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from flashinfer_safe_workspace.agreement import core as C
from flashinfer_safe_workspace.agreement import positions as P
from flashinfer_safe_workspace.agreement import store as _store

PREFIX = "fiws/0/0,1/0/"
TEXTS = ("no|0", "late|0", "interrupted|0")  # this rank's no, its deadline, an interrupt
LONG = 30.0  # a bound never reached when the code is right


class Recorder:
    """A codec that keeps what the core gives it: ``verdict`` commits, ``refuse`` aborts
    with the reason in the text; the texts it made are the complete ones."""

    def __init__(self):
        self.given: list = []

    def verdict(self, payloads):
        self.given.append(("verdict", list(payloads)))
        return "commit"

    def refuse(self, payloads, why):
        self.given.append(("refuse", list(payloads), why))
        return "abort|" + str(why)

    @staticmethod
    def outcome(text):
        head = text.split("|", 1)[0]
        return head if head in (C.COMMIT, C.PASS, C.ABORT) else C.ABORT

    @staticmethod
    def complete(text):
        return text == "commit" or text.startswith("abort|")

    def codec(self) -> C.Codec:
        return C.Codec(self.verdict, self.refuse, self.outcome, self.complete)


def make(me=0, size=2, yes=True, call="c", deadline=10.0, grace=1.0):
    rec = Recorder()
    setup = C.Setup(PREFIX, size, me, yes, call, f"record of {me}", deadline, grace, TEXTS,
                    rec.codec())
    return C.Core(setup), rec


def op(kind, key, value="", n=0, tag="", line="wait"):
    return C.Op(kind, PREFIX + key, value, n, tag, line)


OUT = op("add", "o", n=1, tag=C.T_OUT)


def counted_in(size=2, **kw):
    """A yes rank that arrived and counted itself in, not last: waiting for the register."""
    core, rec = make(size=size, **kw)
    core, _ = core.start()
    core, ops = core.on_reply(C.T_COUNT, 1)
    assert ops == [op("wait", "d", tag=C.T_WAIT)]
    return core, rec


def completing(size=2, **kw):
    """A yes rank whose add completed the count: it reads every record next."""
    core, rec = make(size=size, **kw)
    core, _ = core.start()
    core, ops = core.on_reply(C.T_COUNT, size)
    assert ops == [op("get", "r", tag=C.T_READ)] and core.phase == C.READ
    return core, rec


def line(pos, call="c", flag="y", payload=None):
    return f"{pos} {flag} {call}\t{payload if payload is not None else f'record of {pos}'}\n"


# --------------------------------------------------------------------------- the table


def test_a_yes_appends_its_record_then_counts_itself_in():
    core, _ = make()
    core, ops = core.start()
    assert ops == [op("append", "r", "0 y c\trecord of 0\n"), op("add", "n", n=1, tag=C.T_COUNT)]
    assert core.phase == C.COUNT and core.wake_at() == 10.0
    assert core.start() == (core, [])  # one arrival per round


def test_a_no_appends_its_record_and_writes_its_abort_at_once():
    core, _ = make(yes=False)
    core, ops = core.start()
    assert ops == [op("append", "r", "0 n c\trecord of 0\n"), op("cas", "d", "no|0", tag=C.T_WRITE)]
    core, ops = core.on_reply(C.T_WRITE, "no|0")
    assert (core.answer, core.register, core.decider, ops) == (C.ABORT, "no|0", True, [OUT])


def test_a_rank_that_said_no_never_creates():
    """Even a register that says commit (never written while a rank said no) is an abort
    for the rank that said no."""
    core, _ = make(yes=False)
    core, _ = core.start()
    core, ops = core.on_reply(C.T_WRITE, "commit")
    assert (core.answer, core.register, core.decider, ops) == (C.ABORT, "commit", False, [OUT])


def test_the_count_completer_reads_the_records_and_writes_the_verdict():
    core, rec = completing()
    core, ops = core.on_reply(C.T_READ, line(1) + line(0))
    assert rec.given == [("verdict", ["record of 0", "record of 1"])]  # in position order
    assert ops == [op("cas", "d", "commit", tag=C.T_WRITE)] and core.phase == C.WRITE
    core, ops = core.on_reply(C.T_WRITE, "commit")
    assert (core.answer, core.decider, ops) == (C.COMMIT, True, [OUT])


def test_the_register_another_rank_wrote_first_is_the_answer():
    core, _ = completing()
    core, _ = core.on_reply(C.T_READ, line(0) + line(1))
    core, ops = core.on_reply(C.T_WRITE, "late|1")  # a peer's deadline abort came first
    assert (core.answer, core.register, core.decider, ops) == (C.ABORT, "late|1", False, [OUT])


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_verdict_gets_the_payloads_in_position_order_whatever_their_text(order):
    """Records are appended in arrival order; the codec sees them by position (the
    payloads' own text sorts the other way)."""
    core, rec = completing()
    payloads = {0: "z: rank 0's record", 1: "a: rank 1's record"}
    core.on_reply(C.T_READ, "".join(line(p, payload=payloads[p]) for p in order))
    assert rec.given == [("verdict", [payloads[0], payloads[1]])]


def test_records_of_another_call_abort_naming_the_mismatch():
    core, rec = completing()
    core, ops = core.on_reply(C.T_READ, line(0) + line(1, call="other"))
    why = "ranks called with different arguments"
    assert rec.given == [("refuse", ["record of 0", "record of 1"], why)]
    assert ops == [op("cas", "d", "abort|" + why, tag=C.T_WRITE)]


@pytest.mark.parametrize("blob,held", [
    (None, 0),  # the round's records are gone (removed under a late rank's feet)
    (b"", 0),
    (line(0), 1),
    (line(0) + line(0) + line(1), 3),
])
def test_a_round_without_one_record_per_rank_aborts_naming_the_count(blob, held):
    core, rec = completing()
    core, ops = core.on_reply(C.T_READ, blob)
    why = f"the round holds {held} records for 2 ranks"
    assert [g[0] for g in rec.given] == ["refuse"] and rec.given[0][2] == why
    assert len(rec.given[0][1]) == held  # the records' payloads, for its explanation
    assert ops == [op("cas", "d", "abort|" + why, tag=C.T_WRITE)]


@pytest.mark.parametrize("bad", [
    "garbled",  # one word: no position, no flag, no call
    "x y c",  # a position that is not a number
    "1 y",  # no call
    "1 y c extra",  # a word too many
    "\u0661 y c",  # a digit, but not an ASCII one: not a position we write
])
def test_a_record_line_that_does_not_parse_is_no_rank_s(bad):
    """Rank 0's record and a line that does not parse, with the call of this round: no
    commit, and no error raised out of the core."""
    core, rec = completing()
    core, ops = core.on_reply(C.T_READ, line(0) + bad + "\tpayload\n")
    assert [g[0] for g in rec.given] == ["refuse"]
    assert rec.given[0][2] == "the round holds 2 records for 2 ranks"
    assert ops[0].value.startswith("abort|")


def test_records_that_are_not_utf8_are_read_without_raising():
    core, rec = completing()
    blob = (line(0) + line(1, payload="bad \udcff byte")).encode("utf-8", "surrogateescape")
    core, ops = core.on_reply(C.T_READ, blob)
    assert rec.given == [("verdict", ["record of 0", "bad \ufffd byte"])]
    core, ops = core.on_reply(C.T_WRITE, b"commit \xff")  # a register read as bytes, too
    assert core.answer == C.ABORT and core.register == "commit \ufffd"


def test_a_waiting_rank_reads_the_register_once_woken():
    core, _ = counted_in()
    core, ops = core.on_reply(C.T_WAIT, None)
    assert ops == [op("get", "d", tag=C.T_FETCH)] and core.phase == C.FETCH
    core, ops = core.on_reply(C.T_FETCH, b"commit")
    assert (core.answer, core.register, core.decider, ops) == (C.COMMIT, "commit", False, [OUT])


def test_a_wake_up_for_nothing_waits_again_and_then_looks_before_it_reads():
    core, _ = counted_in()
    core, _ = core.on_reply(C.T_WAIT, None)
    core, ops = core.on_reply(C.T_FETCH, None)  # an outsider's read of the missing register
    assert ops == [op("wait", "d", tag=C.T_WAIT)] and core.phase == C.WAIT
    core, ops = core.on_reply(C.T_WAIT, None)
    assert ops == [op("check", "d", tag=C.T_FETCH)]  # a check wakes nobody
    core, ops = core.on_reply(C.T_FETCH, False)  # still missing
    assert ops == [op("wait", "d", tag=C.T_WAIT)]
    core, _ = core.on_reply(C.T_WAIT, None)
    core, ops = core.on_reply(C.T_FETCH, True)  # there now: read it
    assert ops == [op("get", "d", tag=C.T_FETCH)] and core.answer is None
    core, ops = core.on_reply(C.T_FETCH, "commit")
    assert core.answer == C.COMMIT and ops == [OUT]


def test_a_reply_the_phase_does_not_expect_changes_nothing():
    core, _ = counted_in()
    for tag, value in ((C.T_COUNT, 2), (C.T_READ, line(0)), (C.T_WRITE, "commit"), (C.T_OUT, 2)):
        assert core.on_reply(tag, value) == (core, [])


# --------------------------------------------------------------------------- the deadline


def test_at_its_deadline_a_rank_writes_its_abort_on_the_main_line():
    """The abort must not queue behind the blocking wait on the round's own line."""
    core, _ = counted_in(deadline=10.0, grace=1.0)
    assert core.on_tick(9.5) == (core, [])
    core, ops = core.on_tick(10.0)
    assert ops == [op("cas", "d", "late|0", tag=C.T_ABORT, line="main")]
    assert core.aborting and core.answer is None and core.wake_at() == 11.0
    assert core.on_tick(10.5) == (core, [])  # one abort


def test_an_abort_answered_is_the_answer_even_after_the_register_was_read():
    core, _ = counted_in()
    core, _ = core.on_reply(C.T_WAIT, None)
    core, _ = core.on_tick(10.0)
    core, ops = core.on_reply(C.T_FETCH, "commit")  # read before its abort's reply
    assert ops == [] and core.answer is None  # its count-out must not pass its abort
    core, ops = core.on_reply(C.T_ABORT, "commit")
    assert (core.answer, core.decider, ops) == (C.COMMIT, False, [OUT])


def test_its_own_abort_decided_makes_it_the_decider():
    core, _ = counted_in()
    core, _ = core.on_tick(10.0)
    core, ops = core.on_reply(C.T_ABORT, "late|0")
    assert (core.answer, core.register, core.decider, ops) == (C.ABORT, "late|0", True, [OUT])


def test_within_the_grace_an_unanswered_abort_is_not_yet_in_doubt():
    core, _ = counted_in(deadline=10.0, grace=1.0)
    core, _ = core.on_tick(10.0)
    assert core.on_tick(10.9) == (core, [])  # the grace runs from the abort, not before
    core, ops = core.on_tick(11.0)
    assert (core.answer, ops) == (C.DOUBT, [OUT])


def test_past_the_grace_the_register_read_meanwhile_is_the_answer():
    core, _ = counted_in(deadline=10.0, grace=1.0)
    core, _ = core.on_reply(C.T_WAIT, None)
    core, _ = core.on_tick(10.0)
    core, _ = core.on_reply(C.T_FETCH, "late|1")
    core, ops = core.on_tick(11.0)
    assert (core.answer, core.register, ops) == (C.ABORT, "late|1", [OUT])


def test_while_its_abort_is_unanswered_a_look_at_the_register_is_still_a_look():
    """A ``check`` reply (True or False) is not the register's text: after a wake-up for
    nothing, the look goes on (``get`` when it is there, ``wait`` when not), and without
    the abort's reply the rank is in doubt, never answered with "True" or "False"."""
    core, _ = counted_in(deadline=10.0, grace=1.0)
    core, _ = core.on_reply(C.T_WAIT, None)
    core, _ = core.on_reply(C.T_FETCH, None)  # woken for nothing
    core, _ = core.on_reply(C.T_WAIT, None)  # woken again: it looks first (check)
    core, _ = core.on_tick(10.0)  # its deadline: its abort is on its way
    missing, ops = core.on_reply(C.T_FETCH, False)
    assert ops == [op("wait", "d", tag=C.T_WAIT)] and missing.read is None
    assert missing.on_tick(11.0)[0].answer == C.DOUBT
    there, ops = core.on_reply(C.T_FETCH, True)
    assert ops == [op("get", "d", tag=C.T_FETCH)] and there.read is None
    there, ops = there.on_reply(C.T_FETCH, "commit")
    assert ops == [] and there.answer is None  # kept until the abort's reply or the grace
    assert there.on_tick(11.0)[0].answer == C.COMMIT


def test_an_answered_rank_ignores_time():
    """A tick can reach a core after its answer (the driver's caller computed the wake-up
    before the reply came): it must write nothing more, above all no abort into a round
    whose keys may be gone already."""
    core, _ = counted_in(deadline=10.0)
    core, _ = core.on_reply(C.T_WAIT, None)
    core, _ = core.on_reply(C.T_FETCH, "commit")
    assert core.on_tick(10.0) == (core, []) and core.on_tick(100.0) == (core, [])
    assert core.wake_at() is None
    doubt, _ = counted_in(deadline=10.0)
    doubt, _ = doubt.on_tick(10.0)
    doubt, _ = doubt.on_tick(11.0)
    assert doubt.answer == C.DOUBT and doubt.on_tick(12.0) == (doubt, [])


def test_a_rank_that_has_not_arrived_ignores_time():
    core, _ = make(deadline=10.0)
    assert core.on_tick(100.0) == (core, []) and core.wake_at() is None


def test_a_resumed_process_gives_its_unanswered_abort_the_time_it_lost():
    """Stopped from 10.2 to 20 (9.8 s lost): the abort it sent at 10 (or had still to send)
    gets its reply in the grace after 19.8, not before; nothing else moves."""
    core, _ = counted_in(deadline=10.0, grace=1.0)
    aborting, _ = core.on_tick(10.0)
    resumed, ops = aborting.on_resume(20.0, 9.8)
    assert ops == [] and resumed.abort_at == 19.8 and resumed.wake_at() == 20.8
    assert resumed.on_tick(20.5) == (resumed, [])  # would be in doubt without the resumption
    assert resumed.on_tick(20.8)[0].answer == C.DOUBT
    # never past the moment it runs again, whatever it is told it lost
    assert aborting.on_resume(12.0, 50.0)[0].abort_at == 12.0
    assert aborting.on_resume(9.0, 1.0) == (aborting, [])  # a time before its abort: nothing
    assert aborting.on_resume(10.0, 1.0) == (aborting, [])
    assert aborting.on_resume(20.0, 0.0) == (aborting, [])  # nothing lost: nothing moves
    assert core.on_resume(20.0, 9.8) == (core, [])  # no abort of its own: its deadline stands
    answered, _ = aborting.on_reply(C.T_ABORT, "late|0")
    assert answered.on_resume(30.0, 20.0) == (answered, [])


def test_a_process_starved_again_and_again_is_in_doubt_after_a_grace_of_its_running_time():
    """Issue 29's re-review (C2): each resumption moved the abort's due time to the
    resumption itself, so a process whose every slice ran late (a thread holding the GIL
    for a second at a time) waited as long as the starvation lasted. Only the lost time
    moves it: the driver's loop (slices of at most 0.1 s, each 0.5 s late) is in doubt
    after about grace / 0.1 slices."""
    core, _ = counted_in(deadline=10.0, grace=1.0)
    core, _ = core.on_tick(10.0)
    now, slices = 10.0, 0
    while core.answer is None:
        slices += 1
        assert slices <= 20, (now, core.abort_at)
        asked = min(0.1, max(core.wake_at() - now, 0.0))
        now += asked + 0.5
        core, _ = core.on_resume(now, 0.5)
        core, _ = core.on_tick(now) if now >= core.wake_at() else (core, [])
    assert core.answer == C.DOUBT and 10 <= slices <= 12, slices


def test_a_store_error_on_its_abort_answers_from_the_register_read_else_doubt():
    core, _ = counted_in(deadline=10.0)
    core, _ = core.on_reply(C.T_WAIT, None)
    aborting, _ = core.on_tick(10.0)
    doubt, ops = aborting.on_error()
    assert (doubt.answer, ops) == (C.DOUBT, [OUT])
    read, _ = aborting.on_reply(C.T_FETCH, "commit")
    decided, ops = read.on_error()
    assert (decided.answer, decided.register, ops) == (C.COMMIT, "commit", [OUT])
    assert decided.on_error() == (decided, []) and doubt.on_error() == (doubt, [])


# --------------------------------------------------------------------------- interrupts


def test_an_interrupt_writes_the_interrupt_s_abort_once():
    core, _ = counted_in()
    core, ops = core.on_interrupt(5.0)
    assert ops == [op("cas", "d", "interrupted|0", tag=C.T_ABORT, line="main")]
    assert core.aborting and core.abort_at == 5.0 and core.proposed == ("interrupted|0",)
    assert core.on_interrupt(6.0) == (core, []) and core.on_tick(5.5) == (core, [])
    core, ops = core.on_reply(C.T_ABORT, "interrupted|0")
    assert (core.answer, core.decider, ops) == (C.ABORT, True, [OUT])
    assert core.on_interrupt(7.0) == (core, [])  # answered: nothing more


def test_the_ranks_whose_record_is_in_are_its_parsed_positions():
    assert C.arrived(line(1) + "garbled\tx\n" + line(0)) == {0, 1}
    assert C.arrived(line(0).encode()) == {0} and C.arrived(line(2)) == {2}
    assert C.arrived(b"") == set() and C.arrived(None) == set()


# --------------------------------------------------------------------------- the count-out


def test_the_last_rank_out_deletes_the_round_s_keys():
    core, _ = counted_in()
    core, _ = core.on_reply(C.T_WAIT, None)
    core, _ = core.on_reply(C.T_FETCH, "commit")
    left, ops = core.on_reply(C.T_OUT, 1)
    assert ops == [] and left.out == 1
    last, ops = core.on_reply(C.T_OUT, 2)
    assert ops == [op("delete", k) for k in ("r", "n", "d", "o")]


def test_a_cached_veto_posts_its_abort_and_counts_out():
    core, _ = make(yes=False)
    core, ops = core.skip()
    assert ops == [op("cas", "d", "no|0"), OUT] and core.answer == C.ABORT
    assert core.skip() == (core, []) and core.start() == (core, [])
    short, ops = core.on_reply(C.T_OUT, 1)
    assert ops == [] and C.leftover(short)  # a peer has not counted out: remembered
    last, ops = core.on_reply(C.T_OUT, 2)
    assert ops == [op("delete", k) for k in ("r", "n", "d", "o")] and not C.leftover(last)


def test_only_an_abort_counted_out_short_is_a_leftover():
    core, _ = counted_in()
    core, _ = core.on_reply(C.T_WAIT, None)
    committed, _ = core.on_reply(C.T_FETCH, "commit")
    aborted, _ = core.on_reply(C.T_FETCH, "late|1")
    assert not C.leftover(committed.on_reply(C.T_OUT, 1)[0])
    assert C.leftover(aborted.on_reply(C.T_OUT, 1)[0])
    assert not C.leftover(aborted) and not C.leftover(aborted.on_reply(C.T_OUT, 2)[0])


def test_leftovers_go_once_a_later_round_s_register_is_the_count_completer_s():
    old = ["fiws/0/0,1/0/", "fiws/0/0,1/1/"]
    gone = [C.Op("delete", p + k) for p in old for k in ("r", "n", "d", "o")]
    assert C.forget(old) == gone
    core, _ = counted_in()
    core, _ = core.on_reply(C.T_WAIT, None)
    assert C.sweep(core, old) == []  # no answer yet
    assert C.sweep(core.on_reply(C.T_FETCH, "commit")[0], old) == gone
    assert C.sweep(core.on_reply(C.T_FETCH, "late|1")[0], old) == []  # a deadline's: not all came


# --------------------------------------------------------------------------- positions


def test_each_call_on_a_rank_set_takes_the_next_position():
    group = P.Group()
    assert [group.take("a") for _ in range(3)] == [0, 1, 2]
    assert group.take("b") == 0  # each rank set counts its own
    assert group.skip("a") == 3 and group.take("a") == 4  # a call without a round takes one too


def _bounded(fn):
    """``fn()`` on a thread, joined within LONG: its result (the test fails if it hangs)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(LONG)
    assert not worker.is_alive() and out, "the wait did not end"
    return out[0]


def test_a_rank_s_rounds_on_a_set_run_in_position_order():
    group = P.Group()
    past = time.monotonic() - 1.0  # a deadline already passed: no wait
    assert _bounded(lambda: group.turn("a", 0, past))  # the first position's turn is now
    assert not _bounded(lambda: group.turn("a", 1, past))  # position 0 is not done
    group.done("a", 1)  # done out of order: position 0 still holds the front
    assert not _bounded(lambda: group.turn("a", 2, past))
    group.done("a", 0)
    assert _bounded(lambda: group.turn("a", 2, past))  # 0 and 1 done: 2's turn
    assert _bounded(lambda: group.turn("b", 0, past)) and not _bounded(
        lambda: group.turn("b", 1, past))  # another set has its own front
    group.skip("c")  # a skipped position is done at once
    assert _bounded(lambda: group.turn("c", 1, past))


def test_positions_done_in_order_move_the_front_of_their_own_set_only():
    group = P.Group()
    past = time.monotonic() - 1.0
    group.done("a", 0)
    group.done("a", 1)
    assert _bounded(lambda: group.turn("a", 2, past))
    group.done("b", 1)  # out of order on b: a's front and c's are not b's
    group.done("c", 0)
    assert _bounded(lambda: group.turn("c", 1, past)) and not _bounded(
        lambda: group.turn("c", 2, past))
    assert not _bounded(lambda: group.turn("b", 2, past))


def test_a_turn_waits_for_the_earlier_position_to_be_done():
    group = P.Group()
    clock = threading.Event()
    fake = types.SimpleNamespace(monotonic=lambda: clock.set() or 1000.0)
    result = []
    saved = sys.modules["time"]

    def waiter():
        result.append(group.turn("a", 1, 1000.5))  # half a second left, for ever (fake clock)

    sys.modules["time"] = fake  # what turn()'s own ``import time`` finds
    try:
        worker = threading.Thread(target=waiter, daemon=True)
        worker.start()
        assert clock.wait(LONG)  # it read the time: it is past its front check
    finally:
        sys.modules["time"] = saved
    group.done("a", 0)  # takes the lock only once the waiter waits, and wakes it
    worker.join(LONG)
    assert result == [True]


def test_a_turn_that_never_comes_ends_at_its_deadline():
    group = P.Group()
    assert _bounded(lambda: group.turn("a", 1, time.monotonic() + 0.05)) is False


def test_leftovers_are_remembered_per_set_and_forgotten_by_name():
    group = P.Group()
    group.forget("a", ["x"])  # nothing remembered: nothing to forget
    assert group.leftovers("a") == []
    for name in ("x", "y", "x"):
        group.remember("a", name)
    group.remember("b", "z")
    assert group.leftovers("a") == ["x", "y"] and sorted(group.leftovers()) == ["x", "y", "z"]
    group.forget("a", ["x"])
    assert group.leftovers("a") == ["y"] and group.leftovers("b") == ["z"]


class _Counter:
    """A store whose ``fiws/worlds`` count starts at ``start`` (earlier groups' ranks)."""

    def __init__(self, start=0):
        self.value, self.adds = start, 0

    def add(self, key, n):
        assert key == P.WORLDS_KEY
        self.adds += 1
        self.value += n
        return self.value


@pytest.mark.parametrize("size,before,generation", [
    (1, 0, 0), (1, 2, 2), (2, 0, 0), (2, 1, 0), (2, 2, 1), (2, 5, 2), (3, 3, 1), (3, 5, 1)])
def test_the_g_th_group_on_a_store_reads_generation_g(size, before, generation):
    """The ranks of the g-th group read g*size+1 .. g*size+size from ``fiws/worlds``."""
    store = _Counter(before)
    group = P.Group()
    line = _store.StoreLine(lambda: store)
    try:
        assert group.generation_by(line, size, time.monotonic() + LONG) == generation
        assert group.generation_by(line, size, time.monotonic() + LONG) == generation
        assert store.adds == 1 and group.start_generation(line, size) is None  # read once
    finally:
        line.close()


class _FailsFirst(_Counter):
    """A store whose first ``add`` fails (a connection reset), the next ones answer."""

    def add(self, key, n):
        if not self.adds:
            self.adds += 1
            raise RuntimeError("Connection reset by peer")
        return super().add(key, n)


def test_a_generation_read_that_failed_is_tried_again_at_the_next_call():
    """The mutation run of issue 29: the failed read stayed pending, so every later call of
    the group failed on the same error. It raises ``StoreUnavailable`` (a store error, not
    ours) and the next call reads the generation."""
    store = _FailsFirst(2)
    group = P.Group()
    line = _store.StoreLine(lambda: store)
    try:
        with pytest.raises(_store.StoreUnavailable, match="generation could not be read"):
            group.generation_by(line, 2, time.monotonic() + LONG)
        assert group.generation_by(line, 2, time.monotonic() + LONG) == 1
        assert store.adds == 2
    finally:
        line.close()


def test_a_new_default_group_starts_anew_and_hands_over_what_it_left_behind(monkeypatch):
    monkeypatch.setattr(P, "_replaced", [])
    clean = P.Group()
    clean.take("a")
    monkeypatch.setattr(P, "GROUP", clean)
    P._new_world()
    fresh = P.current()
    assert fresh is not clean and fresh.take("a") == 0 and P.replaced() == []
    fresh.remember("a", "fiws/0/0,1/0/")
    P._new_world()  # this one left a round behind: its keys go on the new group's line
    assert P.current() is not fresh and P.current().take("a") == 0
    assert P.replaced() == [fresh] and P.replaced() == []  # handed out once


def test_a_forked_child_starts_with_no_group_and_nothing_to_hand_over(monkeypatch):
    parent = P.Group()
    parent.take("a")
    parent.remember("a", "fiws/0/0,1/0/")
    monkeypatch.setattr(P, "GROUP", parent)
    monkeypatch.setattr(P, "_replaced", [P.Group()])
    P._after_fork()
    assert P.current() is not parent and P.current().take("a") == 0
    assert P.current().leftovers() == [] and P.replaced() == []
