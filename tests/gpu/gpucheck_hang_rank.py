"""Case w: one rank of the one-GPU hang, as an engine would run it (issue 23).

    python3 tests/gpu/gpucheck_hang_rank.py --case w --rank R --world-size 2 --port P --params JSON

Both ranks share cuda:0 over a gloo WORLD and call FlashInfer's
``create_allreduce_fusion_workspace(backend="trtllm", ...)``. The script never imports
flashinfer_safe_workspace: the shim is on only when the parent sets
``FLASHINFER_SAFE_WORKSPACE=1`` (the installed wheel's ``.pth`` activates it), so the two
variants run the very same program.

The peer calls first. The starved rank waits until the peer has *entered* the creation,
then takes the GPU's memory, then calls. "Entered" is observed, not guessed: a profile
hook (``sys.setprofile``; it only watches, it changes nothing) in the peer fires when the
peer's thread enters a named function (``params["sync_targets"]``: FlashInfer's fd
exchange without the shim, the shim's agreement with it), and writes a file into
``params["signal_dir"]`` at that moment; the starved rank polls for that file (bounded).
The same hook records every entry into FlashInfer's own creation functions
(``params["fi_targets"]``) on both ranks, so the report can say whether a rank entered
FlashInfer at all. If the call has not returned after ``dump_after_s``, faulthandler
writes every thread's stack to ``signal_dir/stacks-r<rank>.txt`` (where it is blocked).

After its answer each rank stays alive (as a serving engine does) until the parent kills it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback

# Before anything else: what did interpreter start-up (site, .pth) do?
AT_START = {"fiws_imported_at_start": "flashinfer_safe_workspace" in sys.modules,
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith("FLASHINFER_SAFE_WORKSPACE")}}

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpucheck_common import (  # noqa: E402  (never imports flashinfer_safe_workspace)
    Call,
    Group,
    MiB,
    decision_log,
    emit,
    finish,
    make_device,
    run_main,
    settle,
    unified_kwargs,
)

SIGNAL = "peer-entered.json"


def _targets(specs) -> dict:
    """``["module:function", "pkg.*:function"]`` -> {function: [module patterns]}."""
    out: dict = {}
    for spec in specs or ():
        module, _, name = spec.rpartition(":")
        out.setdefault(name, []).append(module)
    return out


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module.startswith(pattern[:-1])
    return module == pattern


class Watch:
    """Records the first entry into each target function, on any thread; the first
    ``sync`` entry also writes the signal file (atomically: write, then rename)."""

    def __init__(self, rank: int, sync_targets, fi_targets, signal_path=None):
        self.rank = rank
        self.tables = (("sync", _targets(sync_targets)), ("flashinfer", _targets(fi_targets)))
        self.names = {name for _, table in self.tables for name in table}
        self.signal_path = signal_path
        self.hits: list = []
        self._seen: set = set()

    def _profile(self, frame, event, arg):  # the interpreter calls this on every call
        if event != "call" or frame.f_code.co_name not in self.names:
            return
        try:  # an exception here would surface in the watched code: never let one out
            name = frame.f_code.co_name
            module = str(frame.f_globals.get("__name__", ""))
            for kind, table in self.tables:
                if any(_matches(module, m) for m in table.get(name, ())):
                    self._hit(kind, f"{module}:{name}", frame)
        except Exception as exc:  # noqa: BLE001
            emit("warning", where="watch", error=f"{type(exc).__name__}: {exc}")

    def _hit(self, kind: str, target: str, frame) -> None:
        if (kind, target) in self._seen:
            return
        self._seen.add((kind, target))
        rec = {"kind": kind, "target": target, "t": time.time(),
               "thread": threading.current_thread().name,
               "stack": [f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                         for f in traceback.extract_stack(frame)][-14:]}
        self.hits.append(rec)
        if kind == "sync" and self.signal_path and not any(
                h["kind"] == "sync" for h in self.hits[:-1]):
            tmp = self.signal_path + f".tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                json.dump(dict(rec, rank=self.rank, pid=os.getpid()), fh)
            os.replace(tmp, self.signal_path)
        emit("entered", **rec)

    def start(self) -> None:
        threading.setprofile(self._profile)
        if hasattr(threading, "setprofile_all_threads"):  # Python 3.12+
            threading.setprofile_all_threads(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)


def wait_for_peer(path: str, timeout: float) -> dict:
    """Poll (every 2 ms, at most ``timeout`` s) for the peer's signal file."""
    start = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - start > timeout:
            return {"observed": False, "waited_s": time.monotonic() - start}
        time.sleep(0.002)
    seen_at = time.time()
    try:
        with open(path) as fh:
            peer = json.load(fh)
    except (OSError, ValueError) as exc:
        peer = {"error": f"{type(exc).__name__}: {exc}"}
    return {"observed": True, "waited_s": time.monotonic() - start, "seen_at": seen_at,
            "peer": peer}


def _is_ours(fn) -> bool:
    return bool(getattr(fn, "_self_flashinfer_safe_workspace", False))


def _describe(result) -> str:
    return "None" if result is None else type(result).__name__


def _starve(dev, p: dict, signal_path: str) -> None:
    """The starved rank: wait for the peer's entry, then take the GPU's memory."""
    sync = wait_for_peer(signal_path, float(p["sync_timeout_s"]))
    emit("sync", **sync)
    start = time.time()
    left = dev.hog().set(int(p["leave_mb"]) * MiB)
    emit("hog", wall_start=start, wall_end=time.time(), left=left, held=dev.hog().held,
         after_sync=sync["observed"])


def case_w(args):
    p, rank, world = args.params, args.rank, args.world_size
    log = decision_log()  # before the call: the shim's decision lines, if it is on
    dev = make_device(rank)
    group = Group(args, dev)
    import flashinfer
    import flashinfer.comm as comm

    settle()
    fn = comm.create_allreduce_fusion_workspace
    module = sys.modules.get("flashinfer_safe_workspace")
    version = getattr(flashinfer, "__version__", "?")
    emit("state", flashinfer=version, flashinfer_file=getattr(flashinfer, "__file__", None),
         shim_imported=module is not None, shim_file=getattr(module, "__file__", None),
         wrapped=_is_ours(fn), **AT_START)
    want = p.get("expect_flashinfer")
    if want and version != want:  # never run the case on a FlashInfer it was not built for
        emit("error", where="version", error={"type": "RuntimeError",
                                              "msg": f"FlashInfer {version}, expected {want}"})
        finish(None, barrier=False)
    starved = rank == p["starve_rank"]
    signal_path = os.path.join(p["signal_dir"], SIGNAL)
    watch = Watch(rank, [] if starved else p["sync_targets"], p["fi_targets"],
                  None if starved else signal_path)
    kw = unified_kwargs(p["shape"], rank, world)
    group.barrier()
    emit("snap", where="before", free=dev.free(), starved=starved)
    if starved:
        _starve(dev, p, signal_path)
    stacks = open(os.path.join(p["signal_dir"], f"stacks-r{rank}.txt"), "w")
    faulthandler.dump_traceback_later(float(p["dump_after_s"]), file=stacks)
    mark = log.mark()
    watch.start()
    ws = None
    with Call("create", starved=starved) as c:
        ws = fn(**kw)
        c.result_note = _describe(ws)
    watch.stop()
    faulthandler.cancel_dump_traceback_later()
    emit("answer", outcome=_describe(ws) if c.error is None else f"raised {c.error['type']}",
         seconds=c.seconds, wall_start=c.wall_start, wall_end=time.time(), error=c.error,
         entered=watch.hits, free_after=dev.free(), **log.since(mark))
    finish(None, linger=True, barrier=False)  # alive after the answer, as an engine is


if __name__ == "__main__":
    run_main({"w": case_w})
