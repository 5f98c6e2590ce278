"""The driver (``agreement/driver.StoreVote``) runs the core on real store lines: ranks
played by threads of this process over one real in-memory ``HashStore``, each with its own
lines and its own group bookkeeping, as processes would. What the core decides is proven by
the checker (test_checker.py); these tests show the wiring: the operations reach the store
in the core's order, replies come back, the deadline reaches the core, a store failure is
doubt, and the clean-up runs after the answer. Outcomes are asserted, never timings: a
wait that must end early has a deadline in the past, one that must not has a long one."""

from __future__ import annotations

import threading
import time

import pytest

from flashinfer_safe_workspace import _decide  # noqa: F401 - registers checks.compare (vote.use_comparison)
from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace import _veto as explain
from flashinfer_safe_workspace.agreement import core as C, driver as D
from flashinfer_safe_workspace.agreement import positions as P, store as _store
from flashinfer_safe_workspace.agreement.record import ABORT, COMMIT, NO, PASS, PASS_STATE, Register
from unit.facts import record

LONG = 30.0  # a bound never reached on the paths asserted here


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.HashStore()


_LINES: list = []


@pytest.fixture(autouse=True)
def _drained():
    """Every line of a test is through its queued count-outs before the next test."""
    yield
    for line in _LINES:
        assert line.submit(lambda s: None).done.wait(LONG)
    _LINES.clear()


def lines(store, wait=True) -> dict:
    out = {"main": _store.StoreLine(lambda: store)}
    if wait:
        out["wait"] = _store.StoreLine(lambda: store)
    _LINES.extend(out.values())
    return out


def known(generation=0) -> P.Group:
    """A group whose generation is known already (read at install time, as in production)."""
    group = P.Group()
    group.generation = generation
    return group


def vote_of(store, me, size=2, *, position=0, group=None, bound=LONG, wait=True, call="c"):
    v = D.StoreVote(tuple(range(size)), me, call, time.monotonic() + bound, bound, position,
                    "unit", lines=lines(store, wait), group=group or known(), size=size)
    v.grace = LONG  # the operations past a deadline in the past are answered, however loaded
    return v  # the machine (the store never fails to here, unless a test makes it)


def together(*pairs):
    """``open()`` then ``vote(record)`` for each (vote, record), each on its own thread."""
    out = [None] * len(pairs)

    def go(i, v, rec):
        v.open()
        out[i] = v.vote(rec)

    threads = [threading.Thread(target=go, args=(i, *p), daemon=True) for i, p in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG + 5)
    assert all(o is not None for o in out), out
    return out


def settled(*votes):
    """Wait (bounded) until every vote's queued operations are through."""
    for v in votes:
        for line in v._lines.values():
            assert line.submit(lambda s: None).done.wait(LONG)


def test_every_rank_yes_commits_on_all_and_the_round_s_keys_go(store):
    vs = [vote_of(store, r, 3) for r in range(3)]
    outs = together(*[(v, record(r)) for r, v in enumerate(vs)])
    assert [o.commit for o in outs] == [True] * 3
    assert {o.register for o in outs} == {outs[0].register}  # one register, read by all
    assert sum(bool(v._seen) for v in vs) == 1  # only the count's completer read the records
    settled(*vs)
    assert not any(store.check([vs[0].prefix + k]) for k in C.KEYS)  # the last out deleted


def test_a_no_aborts_on_both_and_both_name_it(store):
    a, b = vote_of(store, 0), vote_of(store, 1)
    no = record(1, state=NO, reason=R.OUT_OF_MEMORY, device=0, free_bytes=10, peak_bytes=100,
                headroom_bytes=0, failed_bytes=100)
    out_a, out_b = together((a, record(0)), (b, no))
    assert (out_a.commit, out_b.commit) == (False, False)
    for out, rec in ((out_a, record(0)), (out_b, no)):
        info = explain.veto(out, None, None, rec)
        assert info.reasons == (R.OUT_OF_MEMORY,) and info.short == ((1, 0, 90),)


def test_every_rank_passing_is_a_pass_on_both(store):
    a, b = vote_of(store, 0), vote_of(store, 1)
    outs = together((a, record(0, state=PASS_STATE)), (b, record(1, state=PASS_STATE)))
    assert [o.register.outcome for o in outs] == [PASS, PASS]


def test_different_calls_abort_on_both_naming_the_argument(store):
    a, b = vote_of(store, 0, call="x"), vote_of(store, 1, call="y")
    outs = together((a, record(0, call="x", args={"max_token_num": 1})),
                    (b, record(1, call="y", args={"max_token_num": 2})))
    for out in outs:
        assert out.register.outcome == ABORT and R.ARG_MISMATCH in out.register.reasons
        assert "max_token_num differs: 1 on rank 0; 2 on rank 1" in out.register.details


def test_a_rank_whose_peer_never_comes_aborts_at_its_deadline_and_names_it(store):
    a = vote_of(store, 0, bound=0.0)  # its deadline is now: the wait ends at once
    a.open()
    out = a.vote(record(0))
    assert out.register.outcome == ABORT and out.absent == (1,)
    info = explain.veto(out, None, None, record(0))
    assert R.ABSENT in info.reasons and "[1] did not answer" in info.message


def test_a_late_rank_follows_the_abort_its_peer_wrote_at_its_deadline(store):
    a = vote_of(store, 0, bound=0.0)
    a.open()
    a.vote(record(0))
    b = vote_of(store, 1)
    b.open()
    out = b.vote(record(1))  # it completes the count, and its commit loses to the abort
    assert not out.commit and out.register.by == 0
    assert explain.veto(out, None, None, record(1)).reasons == (R.ABORTED,)


def test_an_interrupt_writes_the_abort_its_peer_then_reads(store):
    a = vote_of(store, 0)
    a.open()
    a.abort_now("interrupted")
    b = vote_of(store, 1)
    b.open()
    out = b.vote(record(1))
    assert out.register.outcome == ABORT and out.register.by == 0


def test_without_a_waiting_line_the_wait_polls_with_check(store):
    a, b = vote_of(store, 0, wait=False), vote_of(store, 1, wait=False)
    outs = together((a, record(0)), (b, record(1)))
    assert [o.commit for o in outs] == [True, True]


class Broken:
    """A store whose every operation fails (its host is gone)."""

    def __getattr__(self, name):
        def fail(*a, **k):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_store_that_fails_leaves_the_rank_in_doubt():
    v = D.StoreVote((0, 1), 0, "c", time.monotonic() + LONG, LONG, 0, "unit",
                    lines={"main": _store.StoreLine(Broken)}, group=known(), size=2)
    v.open()  # the generation is known: named without asking the store
    out = v.vote(record(0))
    assert out.in_doubt and not out.commit and "Connection reset" in out.missing


def test_the_generation_names_the_round_and_is_read_once(store):
    group = P.Group()
    store.add(P.WORLDS_KEY, 4)  # two earlier groups of two on this store
    a = vote_of(store, 0, group=group, position=5)
    a.open()
    assert a.prefix == "fiws/2/0-1/5/" and group.generation == 2
    vote_of(store, 0, group=group).open()
    assert int(store.add(P.WORLDS_KEY, 0)) == 5  # one add for the group, not one per call


def test_a_round_left_behind_is_swept_when_a_later_round_completes(store):
    g0, g1 = known(), known()
    a = vote_of(store, 0, group=g0, position=0, bound=0.0)  # rank 1 never takes part
    a.open()
    a.vote(record(0))
    settled(a)
    assert g0.leftovers(a.mkey) == [a.prefix]  # counted out short, after an abort
    assert store.check([a.prefix + "d"])
    b0, b1 = vote_of(store, 0, group=g0, position=1), vote_of(store, 1, group=g1, position=1)
    together((b0, record(0)), (b1, record(1)))
    settled(b0, b1)
    assert not any(store.check([a.prefix + k]) for k in C.KEYS)
    assert g0.leftovers(a.mkey) == []


def test_a_replaced_group_s_leftovers_go_on_the_new_group_s_line(store, monkeypatch):
    old = P.Group()
    old.remember("0-1", "fiws/0/0-1/3/")
    for k in C.KEYS:
        store.set("fiws/0/0-1/3/" + k, "x")
    main = lines(store)["main"]
    D.forget_group(old, main)
    assert main.submit(lambda s: None).done.wait(LONG)
    assert not any(store.check(["fiws/0/0-1/3/" + k]) for k in C.KEYS)


def test_a_replaced_group_s_leftovers_never_take_the_new_group_s_own_rounds(store):
    """The flaky real-rank scenario "the host destroys its default group and initialises a
    new one (a new store)": on a new store the generations start again, so the old group's
    leftover ``fiws/0/0-1/0/`` was the new group's first round, and its keys were deleted
    under the peer's feet (both ranks waited out the vote timeout). A leftover of the new
    group's own generation stays; an earlier generation's goes."""
    old = P.Group()
    old.remember("0-1", "fiws/0/0-1/0/")
    old.remember("0-1", "fiws/1/0-1/2/")
    for prefix in ("fiws/0/0-1/0/", "fiws/1/0-1/2/"):
        for k in C.KEYS:
            store.set(prefix + k, "x")
    main = lines(store)["main"]
    D.forget_group(old, main, 0)
    assert main.submit(lambda s: None).done.wait(LONG)
    assert all(store.check(["fiws/0/0-1/0/" + k]) for k in C.KEYS)
    assert not any(store.check(["fiws/1/0-1/2/" + k]) for k in C.KEYS)


def test_a_cached_veto_posts_its_abort_where_its_peer_votes(store, monkeypatch):
    """A rank answering from its veto cache never publishes: its abort goes into that
    round, so a peer making another call there (or one that did not cache) learns at once."""
    group = known()
    main = lines(store)["main"]
    monkeypatch.setattr(_store, "line", lambda timeout: main)
    cached = Register(ABORT, 0, "rank 0 answered this call from its veto cache",
                      reasons=(R.OUT_OF_MEMORY,), details=("rank 0 was short",), call="a")
    D.post_skip((0, 1), 0, "a", 4, cached.to_text(), LONG, group)
    b = vote_of(store, 1, position=4, call="b")
    b.open()
    out = b.vote(record(1, call="b"))
    assert out.register == cached
    info = explain.veto(out, None, None, record(1, call="b"))
    assert info.reasons == (R.OUT_OF_MEMORY, R.ARG_MISMATCH)  # it made another call there
    settled(b)
    assert main.submit(lambda s: None).done.wait(LONG)
    assert not any(store.check([b.prefix + k]) for k in C.KEYS)  # both counted out


def test_without_a_known_generation_a_cached_veto_posts_nothing(store, monkeypatch):
    monkeypatch.setattr(_store, "line", lambda timeout: pytest.fail("no line is asked for"))
    D.post_skip((0, 1), 0, "a", 0, "abort|{}", LONG, P.Group())


def test_get_if_reads_without_writing(store):
    assert D._get_if(store, "missing") is None and not store.check(["missing"])
    store.set("k", "v")
    assert D._get_if(store, "k") == b"v"


def test_every_operation_of_the_core_runs_on_the_store(store):
    until = time.monotonic() + LONG
    assert D._execute(store, C.Op("append", "r", "a"), until) is None
    D._execute(store, C.Op("append", "r", "b"), until)
    assert store.get("r") == b"ab"
    assert D._execute(store, C.Op("add", "n", n=2), until) == 2
    assert D._execute(store, C.Op("cas", "d", "first"), until) == b"first"
    assert D._execute(store, C.Op("cas", "d", "second"), until) == b"first"
    assert D._execute(store, C.Op("get", "d"), until) == b"first"
    assert D._execute(store, C.Op("check", "d"), until) is True
    assert D._execute(store, C.Op("wait", "d"), until) is None  # there: at once
    assert D._execute(store, C.Op("wait", "nothing"), time.monotonic()) is None  # ran out
    D._execute(store, C.Op("delete", "d"), until)
    assert D._execute(store, C.Op("check", "d"), until) is False
    with pytest.raises(ValueError):
        D._execute(store, C.Op("set", "x"), until)


class _BreaksOnAbort:
    """A connection whose abort write (a compare_set of the register) waits until the test
    says so, then breaks (the store host's connection reset)."""

    def __init__(self, inner, release: threading.Event):
        self.inner, self.release = inner, release

    def compare_set(self, key, expected, desired):
        if desired != D.ABSENT and key.endswith("/d"):
            assert self.release.wait(LONG)
            raise RuntimeError("Connection reset by peer")
        return self.inner.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_abort_whose_connection_breaks_answers_from_the_register_read_meanwhile(store):
    """Issue 29's review (F2): rank 0's deadline abort is in flight when rank 1 commits;
    rank 0's waiting line reads the commit; then the abort's connection breaks. The commit
    it read is its answer (it was in doubt before: a veto beside rank 1's creation)."""
    release = threading.Event()
    main = _store.StoreLine(lambda: _BreaksOnAbort(store, release))
    waiting = _store.StoreLine(lambda: store)
    _LINES.extend([main, waiting])
    a = D.StoreVote((0, 1), 0, "c", time.monotonic(), 0.0, 0, "unit",
                    lines={"main": main, "wait": waiting}, group=known(), size=2)
    a.grace = LONG
    a.open()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(0, a.vote(record(0))), daemon=True)
    t.start()
    b = vote_of(store, 1)
    b.open()
    assert b.vote(record(1)).commit  # its commit wins: rank 0's abort has not reached the store
    for _ in range(int(LONG / 0.01)):  # rank 0's waiting line reads that register
        if a._core is not None and a._core.read is not None:
            break
        time.sleep(0.01)
    release.set()
    t.join(LONG)
    assert out[0].commit and not out[0].in_doubt


def _dead_process() -> tuple:
    """(pid, identity) of a process of this machine that has ended (started and reaped)."""
    import subprocess
    import sys

    from flashinfer_safe_workspace.agreement import process

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    boot, ns, _ = process.identity().split("/")
    ident = f"{boot}/{ns}/{process._start_ticks(child.pid)}"
    child.stdin.close()
    child.wait(LONG)
    return child.pid, ident


def test_a_new_group_never_commits_on_a_yes_of_an_earlier_job_s_dead_process(store):
    """Issue 29's review (F3): on a store that outlives its processes, an earlier job's
    rank 1 counted itself into generation 0 (its rank 0 never did), published its yes and
    was killed. The new job's rank 0 counts generation 0, its rank 1 generation 1: rank 0's
    round 0 completes with the dead process's yes. It was created on rank 0 only; now the
    record's writer is seen gone, and both ranks veto."""
    import dataclasses

    pid, ident = _dead_process()
    old = vote_of(store, 1, group=P.Group())  # the earlier job's rank 1: generation 0
    old.open()
    stale = dataclasses.replace(record(1), pid=pid, proc=ident, at=time.time() - 60)
    core, ops = C.Core(C.Setup(old.prefix, 2, 1, True, "c", stale.to_json(), 0.0, 1.0,
                               ("", "", ""), None)).start()
    for o in ops:  # its start: the record appended, itself counted in; then killed
        store.append(o.key, o.value) if o.kind == "append" else store.add(o.key, o.n)
    new0 = vote_of(store, 0, group=P.Group(), bound=2.0)
    new1 = vote_of(store, 1, group=P.Group(), bound=2.0)
    new0.open()  # counts generation 0 (the earlier job's rank 0 never counted)
    new1.open()  # counts generation 1
    assert new0.prefix == old.prefix != new1.prefix  # the counts collided
    out = [None, None]

    def go(i, v):
        out[i] = v.vote(record(i))
    threads = [threading.Thread(target=go, args=(i, v), daemon=True)
               for i, v in enumerate((new0, new1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG)
    assert not out[0].commit and not out[1].commit
    info = explain.veto(out[0], None, None, record(0))
    assert info.ranks == (1,) and R.ABSENT in info.reasons and str(pid) in info.message


class _Clock:
    """The driver's clock: the real one, plus the time this process "did not run" (a jump
    at the ``at``-th reading from now on, or ``every`` reading late by that much)."""

    def __init__(self):
        self._lock, self.offset, self.readings = threading.Lock(), 0.0, 0
        self.at, self.jump, self.every = None, 0.0, 0.0
        self.jumped = threading.Event()

    def monotonic(self):
        with self._lock:
            self.readings += 1
            self.offset += self.every
            if self.at is not None and self.readings >= self.at:
                self.offset, self.at = self.offset + self.jump, None
                self.jumped.set()
            return time.monotonic() + self.offset

    def jump_after(self, readings: int, seconds: float) -> None:
        with self._lock:
            self.at, self.jump = self.readings + readings, seconds

    sleep = staticmethod(time.sleep)


class _AbortAnswered:
    """A connection whose abort write (a compare_set of the register) is answered once
    ``ready()`` says so, then after ``lag`` (the reply read after the process resumed)."""

    def __init__(self, inner, ready, lag: float):
        self.inner, self.ready, self.lag = inner, ready, lag

    def compare_set(self, key, expected, desired):
        if desired != D.ABSENT and key.endswith("/d"):
            assert self.ready()
            time.sleep(self.lag)
        return self.inner.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _alone(store, clock, monkeypatch, ready, lag=0.0, grace=1.0):
    """Rank 0 of two, its peer never coming: its deadline is now, its grace ``grace``."""
    monkeypatch.setattr(D, "time", clock)
    main = _store.StoreLine(lambda: _AbortAnswered(store, ready, lag))
    waiting = _store.StoreLine(lambda: store)
    _LINES.extend([main, waiting])
    v = D.StoreVote((0, 1), 0, "c", clock.monotonic() + 0.05, 0.05, 0, "unit",
                    lines={"main": main, "wait": waiting}, group=known(), size=2)
    v.grace = grace
    v.open()
    return v


@pytest.mark.parametrize("reading", range(1, 9))
def test_a_stop_anywhere_in_the_wait_loop_is_not_the_store_s_time(store, monkeypatch, reading):
    """Issue 29's re-review (C1): the process stopped for 5 s (past the 1 s grace) while
    its abort was on its way, its reply read 50 ms after it ran again. A stop between the
    loop's reading of the time and its start of the next slice was missed: the rank was in
    doubt beside the register the store held. Stopped at each of the calling thread's next
    eight readings of the clock, it answers with the register."""
    clock = _Clock()

    def ready():
        clock.jump_after(reading, 5.0)
        return clock.jumped.wait(LONG)
    v = _alone(store, clock, monkeypatch, ready, lag=0.05)
    out = v.vote(record(0))
    assert not out.in_doubt and not out.commit and out.register is not None, out


def test_a_process_starved_in_every_slice_is_in_doubt_after_a_grace_of_running_time(
        store, monkeypatch):
    """Issue 29's re-review (C2): every reading of the clock 0.2 s late (the slices 0.4 s
    longer than asked: a thread holding the GIL), the store never answering the abort. Each
    slice used to move the abort's due time to its own end, so the rank waited as long as
    the starvation lasted. It is in doubt after about a grace of its own running time."""
    clock, release = _Clock(), threading.Event()
    v = _alone(store, clock, monkeypatch, lambda: release.wait(LONG))
    clock.every = 0.2
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(0, v.vote(record(0))), daemon=True)
    t.start()
    t.join(10.0)
    release.set()
    assert 0 in out and out[0].in_doubt, "still waiting after 10 s"


class _ResetsOnAbort:
    """A connection whose abort write (a compare_set of the register) fails at once (the
    connection reset before the request reached the store)."""

    def __init__(self, inner):
        self.inner = inner

    def compare_set(self, key, expected, desired):
        if desired != D.ABSENT and key.endswith("/d"):
            raise RuntimeError("Connection reset by peer")
        return self.inner.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_abort_whose_connection_resets_waits_the_grace_for_the_register(store):
    """Issue 29's re-review (M2): rank 0's deadline abort failed at once on a reset
    connection, and rank 0 was in doubt at once; rank 1, arriving within the grace,
    completed the count and committed: a veto beside a creation. Rank 0's waiting line
    still waits on the register: it reads rank 1's commit, which is rank 0's answer, at
    once (a register read is final: not at the end of the grace, the third review's 4)."""
    out = _abort_fails_then_peer_commits(store, lambda: _ResetsOnAbort(store))
    assert out.commit and not out.in_doubt and out.elapsed_s < LONG / 2, out


def _abort_fails_then_peer_commits(store, opener):
    """Rank 0 alone at its deadline, its abort on a main line opened by ``opener`` (which
    fails it); once it has failed, rank 1 votes yes and commits. Rank 0's outcome."""
    main = _store.StoreLine(opener)
    waiting = _store.StoreLine(lambda: store)
    _LINES.extend([main, waiting])  # (one that cannot connect fails the drain's check at once)
    a = D.StoreVote((0, 1), 0, "c", time.monotonic(), 0.0, 0, "unit",
                    lines={"main": main, "wait": waiting}, group=known(), size=2)
    a.grace = LONG
    a.open()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(0, a.vote(record(0))), daemon=True)
    t.start()
    for _ in range(int(LONG / 0.01)):  # rank 0's abort has failed
        if a._error is not None:
            break
        time.sleep(0.01)
    b = vote_of(store, 1)
    b.open()
    assert b.vote(record(1)).commit
    t.join(LONG)
    return out[0]


class _JumpClock:
    """The real clock plus what the test adds to ``offset`` (time this process "lost")."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self):
        return time.monotonic() + self.offset

    sleep = staticmethod(time.sleep)


class _StopsAtAbort:
    """Rank 0's main connection: at its abort, its peer commits (``peer``); after
    ``before`` s the store answers; rank 0 "stops" 5 s (the clock jumps), and reads the
    reply ``lag`` s after it runs again."""

    def __init__(self, inner, clock, peer, before=0.0, lag=0.05, resumed=None, answer_first=False):
        self.inner, self.clock, self.peer = inner, clock, peer
        self.before, self.lag, self.resumed, self.answer_first = before, lag, resumed, answer_first

    def compare_set(self, key, expected, desired):
        if desired == D.ABSENT or not key.endswith("/d"):
            return self.inner.compare_set(key, expected, desired)
        time.sleep(self.before)
        self.peer()
        if self.answer_first:  # the store answers, and the process stops at once
            value = self.inner.compare_set(key, expected, desired)
        else:
            time.sleep(0.05)  # the calling thread is in its wait (or its poll) by now
        self.clock.offset += 5.0
        if self.resumed is not None:
            self.resumed.set()
        time.sleep(self.lag)
        return value if self.answer_first else self.inner.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _WokenAfter:
    """A waiting connection whose wake-up, come while the process was stopped, is handled
    once it runs again (then 0.1 s more)."""

    def __init__(self, inner, resumed):
        self.inner, self.resumed = inner, resumed

    def wait(self, keys, *args):
        out = self.inner.wait(keys, *args)
        if self.resumed.wait(LONG):
            time.sleep(0.1)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _stopped_at_abort(store, monkeypatch, conn, wait_conn=None, polling=False):
    clock, out = _JumpClock(), {}
    monkeypatch.setattr(D, "time", clock)
    monkeypatch.setattr(_store, "time", clock)

    def peer():
        b = vote_of(store, 1)
        b.open()
        out[1] = b.vote(record(1))
    ls = {"main": _store.StoreLine(lambda: conn(store, clock, peer))}
    if not polling:
        ls["wait"] = _store.StoreLine(lambda: (wait_conn or (lambda s: s))(store))
    _LINES.extend(ls.values())
    a = D.StoreVote((0, 1), 0, "c", clock.monotonic() + 0.05, 0.05, 0, "unit", lines=ls,
                    group=known(), size=2)
    a.grace = 1.0
    a.open()
    out[0] = a.vote(record(0))
    return out


@pytest.mark.parametrize("polling", [False, True], ids=["waiting line", "polling"])
def test_a_stop_while_polling_is_not_the_store_s_time(store, monkeypatch, polling):
    """Issue 29's third review (1): without a waiting line the calling thread spends its
    wait in the poll, which queues behind the abort on the main line; the poll's time was
    left out of the slices, so a stop there was never counted, and the rank was in doubt
    beside its peer's commit. The poll is bounded by a slice and inside it."""
    out = _stopped_at_abort(store, monkeypatch, lambda s, c, p: _StopsAtAbort(s, c, p, lag=0.15),
                            polling=polling)
    assert out[1].commit and out[0].commit and not out[0].in_doubt, out


@pytest.mark.parametrize("before", [0.5, 0.9, 0.96])
def test_a_stop_at_the_end_of_the_grace_reads_the_replies_that_came_meanwhile(
        store, monkeypatch, before):
    """Issue 29's third review (2): the store answered the abort (its peer's commit) within
    the grace, while the rank was stopped, in the last 50 ms of its grace; the slice that
    found the stop also ticked, before the reply was read: in doubt beside the commit. The
    slice after a resumption reads what came meanwhile first."""
    resumed = threading.Event()
    out = _stopped_at_abort(
        store, monkeypatch,
        lambda s, c, p: _StopsAtAbort(s, c, p, before=before, resumed=resumed, answer_first=True),
        wait_conn=lambda s: _WokenAfter(s, resumed))
    assert out[1].commit and out[0].commit and not out[0].in_doubt, out


def test_a_waiting_line_that_cannot_connect_falls_back_to_polling(store):
    """Issue 29's third review (side note): a store that cannot be cloned gives no waiting
    line; its connection failed on the line's thread, nobody was told, and the round's
    operations sat in its queue until the vote timeout. They move to the main line (the
    wait becomes polling) and the round commits at once."""
    def no_clone():
        raise _store.StoreUnavailable("the default store cannot be cloned: no waiting line")

    votes = []
    for r in range(2):
        ls = {"main": _store.StoreLine(lambda: store), "wait": _store.StoreLine(no_clone)}
        _LINES.append(ls["main"])
        votes.append(D.StoreVote((0, 1), r, "c", time.monotonic() + LONG, LONG, 0, "unit",
                                 lines=ls, group=known(), size=2))
    outs = together(*[(v, record(i)) for i, v in enumerate(votes)])
    assert all(o.commit and o.elapsed_s < LONG / 2 for o in outs), outs


def test_an_abort_whose_line_cannot_connect_waits_the_grace_for_the_register(store):
    """Issue 29's fourth review (M1): the main line could not connect for the abort (a
    reset on another connection marks the store host gone for new connections); the line
    told the driver with no operation, so the abort branch was skipped and the rank was in
    doubt at once, beside rank 1's commit. The queued abort is the one that failed."""
    def no_connect():
        raise _store.StoreUnavailable("the c10d store is gone: (a reset on another connection)")
    out = _abort_fails_then_peer_commits(store, no_connect)
    assert out.commit and not out.in_doubt, out


class _TwoStops(_Clock):
    """The calling thread's clock jumps 5 s at its next reading once armed and, with
    ``second``, 5 s again two readings later: the process stopped, ran a few ms, stopped
    again (other threads read the real clock plus what has jumped so far)."""

    def __init__(self, second):
        super().__init__()
        self.second, self.armed = second, None
        self.tid = threading.get_ident()

    def monotonic(self):
        with self._lock:
            if threading.get_ident() != self.tid:
                return time.monotonic() + self.offset
            self.readings += 1
            if self.armed is not None and self.readings >= self.armed[0]:
                self.offset += 5.0
                self.jumped.set()
                self.armed = (self.readings + 2, 1) if self.second and not self.armed[1] else None
            return time.monotonic() + self.offset

    def arm(self):
        with self._lock:
            self.armed = (self.readings + 1, 0)


class _PeerCommitsThenStops:
    """Rank 0's main connection: at its abort rank 1 commits, rank 0 stops (``_TwoStops``),
    and the reply (the commit) is read 0.3 s after it runs again."""

    def __init__(self, inner, clock, peer):
        self.inner, self.clock, self.peer = inner, clock, peer

    def compare_set(self, key, expected, desired):
        if desired == D.ABSENT or not key.endswith("/d"):
            return self.inner.compare_set(key, expected, desired)
        self.peer()
        self.clock.arm()
        self.clock.jumped.wait(LONG)
        time.sleep(0.3)
        return self.inner.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _WokenAfterJump:
    def __init__(self, inner, clock):
        self.inner, self.clock = inner, clock

    def wait(self, keys, *args):
        out = self.inner.wait(keys, *args)
        if self.clock.jumped.wait(LONG):
            time.sleep(0.3)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("second", [False, True], ids=["one stop", "two stops"])
def test_a_second_stop_right_after_a_resumption_is_not_the_store_s_time(store, monkeypatch, second):
    """Issue 29's fourth review (C1): the slice after a resumption did not credit a stop
    of its own, and ticked with all that time counted: stopped 5 s, run a few ms, stopped
    5 s again, the rank was in doubt beside rank 1's commit. Every stop is credited; only
    the tick of the first slice after a resumption waits."""
    clock, out = _TwoStops(second), {}
    monkeypatch.setattr(D, "time", clock)

    def peer():
        b = vote_of(store, 1)
        b.open()
        out[1] = b.vote(record(1))
    ls = {"main": _store.StoreLine(lambda: _PeerCommitsThenStops(store, clock, peer)),
          "wait": _store.StoreLine(lambda: _WokenAfterJump(store, clock))}
    _LINES.extend(ls.values())
    a = D.StoreVote((0, 1), 0, "c", clock.monotonic() + 0.05, 0.05, 0, "unit", lines=ls,
                    group=known(), size=2)
    a.grace = 1.0
    a.open()
    out[0] = a.vote(record(0))
    assert out[1].commit and out[0].commit and not out[0].in_doubt, out
