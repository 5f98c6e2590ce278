"""One rank's own steps of a decision (plan, checks, probe) under the call's deadline.

A step that blocks (a driver query that hangs, a check stuck on a lock) must not keep its
rank past the vote timeout while the peers have long answered. So the steps run on a
worker thread of their rank set, and the caller waits for them only until its deadline;
then it says no, naming the step that had not returned (``Late``).

The step that blocked goes on in the background: whatever it allocates it releases itself,
as on every path, and its result goes nowhere. A later call on the same rank set waits for
it (again only until its own deadline) rather than running beside it, so two decisions
never share the probe at once; a later call that still finds it running says no, naming it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional


class Progress:
    """Where a running job is: the caller reads ``step`` when it stops waiting."""

    __slots__ = ("step",)

    def __init__(self, step: str = "start"):
        self.step = step


class Late(RuntimeError):
    """The job had not returned by the deadline (``step``: where it was). ``earlier``: it
    never started, an earlier call's job (at ``step``) was still running."""

    def __init__(self, step: str, earlier: bool = False):
        self.step, self.earlier = step, earlier
        where = f"an earlier call's {step} was still running" if earlier else f"{step} had not returned"
        super().__init__(where)


class _Job:
    __slots__ = ("fn", "progress", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any], progress: Progress):
        self.fn, self.progress = fn, progress
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None


class Worker:
    """One thread that runs one job at a time; made on first use, never at import."""

    def __init__(self, name: str):
        self._name = name
        self._cv = threading.Condition(threading.Lock())
        self._running: Optional[_Job] = None  # started or queued, not yet finished
        self._queued: Optional[_Job] = None
        self._thread: Optional[threading.Thread] = None

    def run(self, fn: Callable[[], Any], progress: Progress, deadline: float):
        """``fn()``'s value (or its exception), or ``Late`` at ``deadline`` (monotonic)."""
        job = _Job(fn, progress)
        with self._cv:
            while self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Late(self._running.progress.step, earlier=True)
                self._cv.wait(left)
            self._running = self._queued = job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        if not job.done.wait(max(deadline - time.monotonic(), 0.0)):
            raise Late(progress.step)
        if job.error is not None:
            raise job.error
        return job.value

    def start(self) -> None:
        """Start the thread now (a head start: ``_prepare``); ``run`` starts it otherwise."""
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._queued is None:
                    self._cv.wait()
                job, self._queued = self._queued, None
            try:
                job.value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()
                job.done.set()


_workers: dict = {}
_lock = threading.Lock()


def worker(key: str) -> Worker:
    """The worker of one rank set (``key``), shared by every decision on it."""
    with _lock:
        found = _workers.get(key)
        if found is None:
            found = _workers[key] = Worker("fiws-steps")
        return found


def _after_fork_in_child():
    global _lock
    _workers.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
