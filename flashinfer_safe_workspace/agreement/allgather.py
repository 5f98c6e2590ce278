"""The agreement over a comm backend that has no torch group (MPI, custom): its own
``allgather`` carries the records, then every rank's verdict on what it received."""

from __future__ import annotations

import os
import threading
import time

from . import store as _store
from .record import ABORT, COMMIT, PASS, Record, Register, read_record
from .vote import Outcome, resolve

_blocked: dict = {}  # id(comm) -> (comm, the helper thread still inside its allgather)


class AllgatherRound:
    """A FlashInfer ``CommBackend`` with no torch group (MPI, custom): the records travel
    through its own ``allgather`` on a helper thread. There is no shared register, so
    every rank whose gather completes decides on the same records; a rank whose gather
    does not complete in time vetoes. At most one helper thread per backend can be left
    blocked: while it is, later decisions on that backend veto at once."""

    def __init__(self, comm, size: int, me: int, ident: str, deadline: float, label: str):
        self.comm, self.size, self.me, self.ident = comm, size, me, ident
        self.deadline, self.label = deadline, label
        self.decided = None

    def open(self):
        return None

    def vote(self, record: Record) -> Outcome:
        """Two exchanges: the records, then every rank's verdict on what it received. The
        decision is the AND of the second: a rank that received a short or malformed answer
        says so, and no peer creates."""
        start = time.monotonic()
        got, why = self._gather(record.to_json())
        if got is None and why.startswith("!"):  # blocked or failed: no second exchange
            return Outcome(False, missing=why[1:], elapsed_s=time.monotonic() - start)
        records = [read_record(r) for r in got] if got is not None else None
        verdict = resolve(records) if records is not None else None
        mine = bool(verdict is not None and (verdict.commit or verdict.all_pass))
        second, why2 = self._gather(Register(COMMIT if mine else ABORT, self.me, why).to_json())
        if second is None:
            return Outcome(False, verdict, records or [], missing=why2.lstrip("!"),
                           elapsed_s=time.monotonic() - start)
        answers = [Register.from_json(r) if isinstance(r, (str, bytes)) else
                   Register(ABORT, why=f"not a register: {type(r).__name__}") for r in second]
        every = all(a.commit for a in answers)
        missing = "" if every else (why or "a rank rejected the exchange: " + "; ".join(
            a.why for a in answers if a.why))
        passing = every and mine and not verdict.commit
        return Outcome(every and mine and verdict.commit, verdict, records or [],
                       register=Register(PASS) if passing else None,
                       missing=missing if not every else "", elapsed_s=time.monotonic() - start)

    def _gather(self, obj):
        """(records, "") or (None, why); why starts with "!" when no second exchange can run."""
        key = id(self.comm)
        old = _blocked.get(key, (None, None))[1]
        if old is not None and old.is_alive():
            return None, (f"!an earlier vote on {self.label} is still blocked in its allgather; "
                          "not voting again on it")
        box: dict = {}

        def run():
            try:
                box["value"] = self.comm.allgather(obj)
            except BaseException as exc:  # noqa: BLE001 - reported below
                box["error"] = exc

        thread = threading.Thread(target=run, name="fiws-allgather", daemon=True)
        thread.start()
        while thread.is_alive() and time.monotonic() < self.deadline:
            thread.join(min(_store.SLICE_S, max(self.deadline - time.monotonic(), 0.001)))
        if thread.is_alive():
            _blocked[key] = (self.comm, thread)  # holding the comm: its id stays its own
            return None, f"!{self.label}: allgather did not complete in time"
        if "error" in box:
            return None, (f"!{self.label}: allgather failed: {type(box['error']).__name__}: "
                          f"{box['error']}")
        got = box.get("value")
        if not isinstance(got, (list, tuple)) or len(got) != self.size:
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return None, f"{self.label}: allgather returned {n} records for {self.size} ranks"
        return list(got), ""

    def abort_now(self, why: str) -> None:
        pass


def _after_fork_in_child():
    _blocked.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
