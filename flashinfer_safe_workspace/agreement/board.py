"""Rounds' bookkeeping in this process, and the board: where each rank is right now.

Each rank keeps one board entry per rank set in the store, ``fiws/<ranks>/board/<rank>``
(a :class:`~.record.Board`: its generation, its round, wait/no/done, its arguments, and how
many calls it has made on that set). A rank still waiting for a peer after
``BOARD_AFTER_S`` reads the peers' entries (one ``multi_get``) to tell a slow peer from one
that is making another call:

* a peer waiting at another round that has made *fewer* calls on the set, or as many, is
  behind us or genuinely disagrees: its round is aborted (it learns at once, with both
  values), and we keep waiting, since its next call may be ours;
* a peer waiting at another round that has made *more* calls is ahead of us: it answered
  our call from its veto cache (or took a pass-through) and waits in the next one. We do
  not abort its round, which is the one we are about to join; our own round ends at once;
* a peer that has made fewer calls and *finished* one of them (said no, or was decided) is
  still behind: it comes to ours after the calls it has left, so we keep waiting, unless
  its entry shows no progress for ``BEHIND_S`` (at most a quarter of the vote timeout): a
  call one rank made alone skews the counts for good, and such a peer is then a mismatch;
* a peer that has made as many calls and *finished* another one without us (said no, or was
  decided) will not come: a mismatch, and our round ends.

The call count only orders which of two waiting rounds gives way, so that a rank that
fell behind re-aligns on its next call; every outcome is still written to a register, so a
wrong guess costs one call a veto, never a split.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from .._reasons import ARG_MISMATCH
from . import group as _group, store as _store
from .record import ABORT, WAKE, Board, Record, Register

BOARD_AFTER_S = 0.05  # a round still open this long after this rank counted in looks at boards
BOARD_EVERY_S = 0.1  # and from then on this often
REJOIN_S = 0.5  # a peer whose mismatched call we aborted gets this long to join our round
BEHIND_S = 5.0  # a peer behind us that shows no progress this long (at most a quarter of
# the vote timeout) is not coming: the call counts were skewed by a call only one rank made


class Book:
    """This process's bookkeeping of rounds, per rank set (one per default group, ``BOOK``;
    a round keeps the one it began with): the next
    round of each call, this rank's board generation and call count, the peers'
    generations seen, and the lock that serialises this rank's decisions on a set. Only
    this module writes it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next: dict = {}  # (members key, call) -> this rank's next round of that call
        self._gens: dict = {}  # members key -> this rank's board generation
        self._calls: dict = {}  # members key -> calls this rank made on that set (cache hits too)
        self._seen: dict = {}  # members key -> {peer rank: board generation seen}
        self._set_locks: dict = {}  # members key -> lock serialising decisions on that set
        self._boards: dict = {}  # members key -> ranks whose board entry exists (never deleted)
        self.world: Optional[int] = None  # this default group's generation (``world_of``)

    def set_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._set_locks.setdefault(key, threading.Lock())

    def count_call(self, mkey: str) -> int:
        with self._lock:
            n = self._calls[mkey] = self._calls.get(mkey, 0) + 1
            return n

    def next_round(self, mkey: str, call: str) -> int:
        with self._lock:
            return self._next.get((mkey, call), 0)

    def consume(self, mkey: str, call: str, c: int) -> None:
        with self._lock:
            self._next[(mkey, call)] = max(self._next.get((mkey, call), 0), c + 1)

    def new_generation(self, mkey: str) -> int:
        with self._lock:
            gen = self._gens[mkey] = self._gens.get(mkey, 0) + 1
            return gen

    def seen(self, mkey: str) -> dict:
        with self._lock:
            return dict(self._seen.get(mkey, {}))

    def boards_known(self, mkey: str) -> set:
        with self._lock:
            return set(self._boards.get(mkey, ()))

    def note_boards(self, mkey: str, ranks) -> None:
        with self._lock:
            self._boards.setdefault(mkey, set()).update(ranks)

    def mark_seen(self, mkey: str, rank: int, gen: int) -> None:
        with self._lock:
            marks = self._seen.setdefault(mkey, {})
            marks[rank] = max(marks.get(rank, 0), gen)


BOOK = Book()


def set_lock(key: str) -> threading.Lock:
    return BOOK.set_lock(key)


def count_call(mkey: str) -> int:
    """Count one call of this rank on the rank set ``mkey`` (a round or a cached answer)."""
    return BOOK.count_call(mkey)


def _start_anew():
    global BOOK
    BOOK = Book()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_anew)
_store.on_new_world(_start_anew)  # a new default group: its store holds none of our rounds


WORLDS_KEY = "fiws/worlds"  # every rank of every default group on this store adds 1 once


def world_of(line, book: Book, until: float) -> int:
    """The default group's generation on its store, the same on each of its ranks: each
    rank adds 1 to ``WORLDS_KEY`` once per group (at its first round), so the ranks of the
    n-th group on one store (``init_process_group(store=...)`` again) read values
    n*size+1 .. n*size+size. A board entry of another generation is an earlier group's: it
    is not read (``read_boards``). Where a rank took no part in some earlier group the
    generations differ, and the boards are not read at all: a mismatch then costs the vote
    timeout instead of ending early, never a wrong answer."""
    if book.world is None:
        size = _group.world_size()
        book.world = (int(line.call(lambda s: s.add(WORLDS_KEY, 1), until)) - 1) // size
    return book.world


def _current(book: Book, raw) -> Optional[Board]:
    """A peer's board entry, or None when it is unreadable or an earlier group's (a book
    whose generation is not known yet, no round having opened, takes every entry)."""
    b = Board.from_json(raw)
    return b if b is not None and book.world in (None, b.world) else None


def board_key(mkey: str, rank) -> str:
    return f"fiws/{mkey}/board/{rank}"


def read_boards(line, book: Book, mkey: str, peers: list, until: float) -> tuple:
    """``(seen, {peer: Board or None})``: the generations seen before the read, and the
    peers' board entries in one ``multi_get`` (entries known to exist; an unknown one is
    checked on its own until it appears: entries are never deleted)."""
    known = book.boards_known(mkey)

    def read(s):
        seen = book.seen(mkey)
        found = [r for r in peers if r not in known and s.check([board_key(mkey, r)])]
        have = [r for r in peers if r in known or r in found]
        return seen, found, dict(zip(have, s.multi_get([board_key(mkey, r) for r in have])
                                     if have else []))
    seen, found, raw = line.call(read, until)
    book.note_boards(mkey, found)
    return seen, {r: (_current(book, raw[r]) if r in raw else None) for r in peers}


def note_peers_seen(s, book: Book, mkey: str, peers: list) -> None:
    """On the store thread: note every peer's current board generation as seen."""
    known = book.boards_known(mkey)
    found = [r for r in peers if r not in known and s.check([board_key(mkey, r)])]
    have = [r for r in peers if r in known or r in found]
    book.note_boards(mkey, found)
    for rank, raw in zip(have, s.multi_get([board_key(mkey, r) for r in have]) if have else []):
        peer = _current(book, raw)
        if peer is not None:
            book.mark_seen(mkey, rank, peer.generation)


class Watch:
    """One round's look at its peers' boards (``StoreRound`` owns one)."""

    def __init__(self, rnd):
        self.rnd = rnd
        self._aborted: dict = {}  # peer -> board generation of its round we aborted
        self._done_at: dict = {}  # peer -> when we saw it finish that round
        self._idle: dict = {}  # peer behind us -> (its finished entry, when first seen so)

    def mismatches(self, abort_theirs: bool) -> tuple:
        """Peers whose board shows a call newer than the last one we saw, at another round:
        ``(waiting, finished)`` stand-in records (rank and arguments) for the message.
        ``waiting`` peers make another call right now and will come to ours afterwards;
        ``finished`` peers will not come (the caller ends its own round)."""
        rnd = self.rnd
        peers = [r for r in rnd.ranks if r != rnd.rank]
        try:  # bounded by the deadline itself: the waiting loop must be back by then
            seen, boards = read_boards(rnd.line, rnd.book, rnd.mkey, peers, rnd.deadline)
        except Exception:  # noqa: BLE001 - only an early exit; the deadline still holds
            return [], []
        waiting, finished = [], []
        now = time.monotonic()
        for rank in peers:
            b = boards[rank]
            verdict = self._judge(rank, b, seen, now)
            if verdict is None:
                continue
            stand_in = Record.stand_in(rank, "other", b.args)
            if verdict == "finished":
                finished.append(stand_in)
                continue
            waiting.append(stand_in)
            if abort_theirs:
                self._abort_theirs(rank, b)
        return waiting, finished

    def _judge(self, rank: int, b: Optional[Board], seen: dict, now: float) -> Optional[str]:
        """What a peer's board entry says about our round: ``"waiting"`` (it waits on
        another call now and may come to ours next), ``"finished"`` (it will not come to
        ours: it decided another call without us, or it is ahead of us), or None."""
        rnd = self.rnd
        if b is None or b.round == rnd.round_name:
            return None
        if b.calls < rnd.calls:
            # behind us: it is still making calls we made (or answered from our cache)
            # before this one. Its round of one of them is aborted while it waits there;
            # after one it has finished, it comes to ours once through the calls left,
            # unless that round is news (or one we aborted) and it shows no progress for
            # the patience (see ``_patience``)
            if b.state == "wait":
                self._idle.pop(rank, None)
                return "waiting" if self._new(rank, b, seen) else None
            if self._aborted.get(rank) != b.generation and not self._new(rank, b, seen):
                return None  # an entry of a round we finished too, or saw end: no sign
                # that it is elsewhere, only that it has not come yet
            entry = (b.generation, b.state)
            last = self._idle.get(rank)
            if last is None or last[0] != entry:
                self._idle[rank] = (entry, now)
                return None
            return "finished" if now - last[1] > self._patience() else None
        if self._aborted.get(rank) == b.generation and b.state == "done":
            # a peer whose other call we aborted has finished it: if it does not come to
            # our round soon, it was a mismatch, not a call it made before ours
            since = self._done_at.setdefault(rank, now)
            return "finished" if now - since > REJOIN_S else None
        if not self._new(rank, b, seen):
            return None
        if b.state != "wait" or b.calls > rnd.calls:
            # it decided its own call as the same count as ours without us, or it is ahead
            # of us: our call is one it answered without a round, and it waits in the next
            # one, which is ours to join. Leave its round alone and end ours.
            return "finished"
        return "waiting"

    def _patience(self) -> float:
        """How long a peer behind us may show a finished round and nothing newer before it
        reads as not coming: BEHIND_S, at most a quarter of the vote timeout, at least
        REJOIN_S. Only a call one rank made without its peers (the counts skewed ever
        after) makes a peer look behind that is not: then a mismatch ends our round after
        the patience instead of the whole vote timeout; a peer that is truly behind and
        slower than this costs one call a veto, never a split."""
        t = self.rnd.line_timeout
        return max(REJOIN_S, min(BEHIND_S, t / 4)) if t > 0 else BEHIND_S

    def _new(self, rank: int, b: Board, seen: dict) -> bool:
        """Whether a peer's entry is news: a generation not seen before, of a round that
        this rank has not finished itself (a finished one is old news, and noted seen)."""
        rnd = self.rnd
        if b.generation <= seen.get(rank, 0):
            return False
        call, _, c = b.round.rpartition("/")
        if rnd.book.next_round(rnd.mkey, call) > int(c or 0):
            rnd.book.mark_seen(rnd.mkey, rank, b.generation)
            return False
        return True

    def _abort_theirs(self, rank: int, b: Board) -> None:
        """Abort a peer's round of another call (it learns at once, with both values)."""
        rnd = self.rnd
        call, _, c = b.round.rpartition("/")
        their = "/".join(["fiws", rnd.mkey, call, c])
        note = Register(ABORT, rnd.rank, "ranks called with different arguments",
                        mismatch=(Record.stand_in(rnd.rank, rnd.ident, rnd.args),),
                        reasons=(ARG_MISMATCH,)).to_json()

        def abort(s):
            s.compare_set(their + "/reg", "", note)
            s.compare_set(their + "/ready", "", WAKE)
        try:
            rnd.call_store(abort)
        except Exception:  # noqa: BLE001 - only an early exit; its deadline still holds
            pass
        rnd.book.mark_seen(rnd.mkey, rank, b.generation)
        self._aborted[rank] = b.generation
