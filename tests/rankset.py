"""A long-lived set of real gloo ranks for tests that make many calls (the property test).

Starting a rank set costs seconds (fresh interpreters, torch, a gloo group); a property with
hundreds of examples cannot pay that per example. A ``RankSet`` starts its ranks once; the
test process hosts a small control store (a TCPStore of its own, not the ranks' c10d store)
and hands the ranks one case at a time: it sets ``case/<i>`` (JSON), every rank runs its
``handle(case)`` and sets ``result/<i>/<rank>``. Every wait is bounded:

- the test waits for a case's results at most ``timeout`` seconds, and fails at once when a
  rank process has died; either way the set is torn down (a later ``ask`` starts a new one);
- a rank waits for its next case at most ``FIWS_IDLE_S`` seconds, then leaves (the test went
  away without stopping it);
- ``close`` asks the ranks to leave, gives them a few seconds, then kills what is left.

A rank's own exception in ``handle`` is reported as the case's result (``{"exception": …}``)
so one bad case does not cost the set.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import harness

SERVE = """
import traceback
from torch.distributed import TCPStore
_ctl = TCPStore("127.0.0.1", int(os.environ["FIWS_CTL_PORT"]), is_master=False,
                timeout=datetime.timedelta(seconds=30))
_idle = datetime.timedelta(seconds=float(os.environ.get("FIWS_IDLE_S", "120")))
%s
_ctl.set(f"ready/{RANK}", "1")  # set up: the first case finds every rank waiting for it
_i = 0
while True:
    try:
        _ctl.wait([f"case/{_i}"], _idle)
    except Exception:  # no case within the idle bound: the test went away
        break
    _case = json.loads(_ctl.get(f"case/{_i}"))
    if _case is None:
        break
    try:
        _out = handle(_case)
    except Exception:
        _out = {"exception": traceback.format_exc()[-3000:]}
    _ctl.set(f"result/{_i}/{RANK}", json.dumps(_out, default=str))
    _i += 1
result["cases"] = _i
"""


class RankSetBroken(AssertionError):
    """The set could not answer a case (a rank died or the case ran past its bound)."""


class RankSet:
    """``world`` ranks running ``body`` (which defines ``handle(case) -> JSON-able``)."""

    def __init__(self, world: int, body: str, *, env: dict | None = None, idle_s: float = 120.0):
        from torch.distributed import TCPStore

        self.world, self.body, self.env, self.idle_s = world, body, dict(env or {}), idle_s
        self._TCPStore = TCPStore
        self.procs: list = []
        self.logs: list = []
        self.ctl = None
        self.next_case = 0
        self.started = 0  # how many times ranks were started (a broken set starts again)

    # -- lifetime
    def _start(self) -> None:
        self.ctl = self._TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=30))
        self.next_case = 0
        script = harness.PRELUDE + SERVE % textwrap.dedent(self.body) + harness.EPILOGUE
        port = harness.free_port()
        for rank in range(self.world):
            e = harness.clean_env(**self.env, FIWS_CTL_PORT=self.ctl.port, FIWS_IDLE_S=self.idle_s)
            e.update(FIWS_TEST_RANK=str(rank), FIWS_TEST_WORLD=str(self.world),
                     FIWS_TEST_PORT=str(port))
            log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: never fills up
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, "-c", script], env=e, text=True,
                                               stdout=log, stderr=subprocess.STDOUT))
        self.started += 1
        self._wait([f"ready/{r}" for r in range(self.world)], 180.0, "start")

    def _wait(self, keys, timeout: float, what: str) -> None:
        """Until every key is set; ``RankSetBroken`` (and the set torn down) when a rank
        died or ``timeout`` passed first."""
        end = time.monotonic() + timeout
        while not self.ctl.check(keys):
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > end:
                why = f"ranks {dead} died" if dead else f"no answer within {timeout:.0f} s"
                text = "\n".join(f"--- rank {r}\n{self.output(r)}" for r in range(self.world))
                self.close(grace_s=0)
                raise RankSetBroken(f"rank set of {self.world}, {what}: {why}\n{text}")
            time.sleep(0.01)

    def close(self, grace_s: float = 10.0) -> None:
        """Ask every rank to leave; kill any still there after ``grace_s``. Idempotent."""
        if self.ctl is not None and self.procs:
            try:
                self.ctl.set(f"case/{self.next_case}", json.dumps(None))
            except Exception:  # noqa: BLE001 - the kill below still runs
                pass
        end = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for log in self.logs:
            log.close()
        self.procs, self.logs, self.ctl = [], [], None

    def output(self, rank: int, tail: int = 3000) -> str:
        log = self.logs[rank]
        log.flush()
        log.seek(0)
        return log.read()[-tail:]

    # -- one case
    def ask(self, case, timeout: float) -> list:
        """Every rank's ``handle(case)``, in rank order; ``RankSetBroken`` past ``timeout``."""
        if not self.procs:
            self._start()
        i = self.next_case
        self.next_case += 1
        self.ctl.set(f"case/{i}", json.dumps(case))
        keys = [f"result/{i}/{r}" for r in range(self.world)]
        self._wait(keys, timeout, f"case {i}")
        return [json.loads(self.ctl.get(k)) for k in keys]
