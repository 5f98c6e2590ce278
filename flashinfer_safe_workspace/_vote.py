"""The vote: which CPU group, one bounded collective, the AND of every rank's answer.

Each rank contributes a fixed-size int64 record (its yes/no bit, the digest of its
plan, its deadline, and the numbers of its reason). The decision is the bitwise AND
of the yes bits, and only if every digest agrees and every record is still within
every rank's deadline. The records travel in one ``all_gather`` over a gloo group,
so the reasons come with the decision and no second collective is needed.

Why not a bare ``all_reduce(BAND)``: gloo sends a rank's contribution as soon as it
enters the collective. A rank whose wait timed out (and who therefore vetoed) has
already sent its "yes"; a peer arriving late would complete the all-reduce with it
and create the workspace alone. With the deadline in the record, the late peer sees
that the yes has expired and vetoes too. A group on which a vote timed out is never
used again (its collectives are out of step): later votes on it veto at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from typing import Sequence

from ._log import logger, rank_tag

# record layout (int64 each)
FIELDS = ("magic", "ok", "digest", "deadline_ms", "reason", "device", "failed_bytes",
          "free_bytes", "cuda_error", "peak_bytes", "headroom_bytes", "pid", "global_rank",
          "multicast", "failed_headroom")
MAGIC = 0x46495753  # "FIWS"
_INDEX = {name: i for i, name in enumerate(FIELDS)}


def make_record(**values: int) -> list:
    record = [0] * len(FIELDS)
    record[0] = MAGIC
    for name, value in values.items():
        record[_INDEX[name]] = int(value)
    return record


def field(record: Sequence[int], name: str) -> int:
    return int(record[_INDEX[name]])


class VoteTimeout(RuntimeError):
    def __init__(self, message: str, absent=()):
        super().__init__(message)
        self.absent = list(absent)


class Channel:
    """A set of ranks that can exchange records, bounded in time."""

    ranks: tuple = ()  # global ranks, in group order (or group indices for comm backends)
    index: int = 0  # this rank's position
    label: str = ""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def gather(self, record: list, timeout_s: float) -> list:
        raise NotImplementedError


NO_PROCESS_GROUP = "torch.distributed not initialised"


class LocalChannel(Channel):
    """One rank (world_size 1 or no process group): nothing to exchange."""

    def __init__(self, label: str = "local"):
        self.ranks, self.index, self.label = (0,), 0, label

    def gather(self, record, timeout_s):
        return [list(record)]


_poisoned: set = set()
_sequence: dict = {}  # votes made per group on this rank (the same on every member)
_poison_lock = threading.Lock()


class TorchGroupChannel(Channel):
    """A torch.distributed group with a gloo backend."""

    def __init__(self, group, label: str):
        import torch.distributed as dist

        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.index = dist.get_rank(group)
        self.label = label

    def key(self):
        return ("torch", self.ranks, id(self.group))

    def gather(self, record, timeout_s):
        import torch
        import torch.distributed as dist

        with _poison_lock:
            if self.key() in _poisoned:
                raise VoteTimeout(f"an earlier vote on group {self.label} timed out; "
                                  "its collectives are out of step, so it is not used again")
            seq = _sequence.get(self.key(), 0) + 1
            _sequence[self.key()] = seq
        arrival = self._mark_arrival(seq)
        mine = torch.tensor(record, dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in self.ranks]
        try:
            work = dist.all_gather(out, mine, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as exc:
            self.poison()
            absent = self._absent(arrival)
            who = f"; ranks that never reached the vote: {absent}" if absent else ""
            raise VoteTimeout(f"{type(exc).__name__}: {str(exc).strip()[:300]}{who}",
                              absent=absent) from exc
        return [t.tolist() for t in out]

    def _mark_arrival(self, seq):
        """Note our arrival in the default store (best effort, non-blocking), so that a
        timed-out vote can name the ranks that never came."""
        try:
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            prefix = f"fiws/vote/{'-'.join(map(str, self.ranks))}/{seq}/"
            store.set(prefix + str(self.ranks[self.index]), "1")
            return store, prefix
        except Exception:
            return None

    def _absent(self, arrival) -> list:
        if arrival is None:
            return []
        store, prefix = arrival
        try:
            return [r for r in self.ranks if not store.check([prefix + str(r)])]
        except Exception:
            return []

    def poison(self):
        with _poison_lock:
            _poisoned.add(self.key())


class CommBackendChannel(Channel):
    """A FlashInfer ``CommBackend`` without a torch group (MPIBackend, custom ones):
    the records go through its ``allgather``, on a helper thread bounded by the timeout."""

    def __init__(self, comm, label: str):
        self.comm = comm
        size, index = int(comm.Get_size()), int(comm.Get_rank())
        self.ranks, self.index, self.label = tuple(range(size)), index, label

    def gather(self, record, timeout_s):
        with _poison_lock:
            if ("comm", id(self.comm)) in _poisoned:
                raise VoteTimeout(f"an earlier vote on {self.label} timed out")
        box: dict = {}

        def run():
            try:
                box["value"] = self.comm.allgather(list(record))
            except BaseException as exc:  # reported to the caller below
                box["error"] = exc

        thread = threading.Thread(target=run, name="fiws-vote", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive() or "error" in box:
            with _poison_lock:
                _poisoned.add(("comm", id(self.comm)))
            why = box.get("error", "timed out")
            raise VoteTimeout(f"{self.label}: {why}")
        return [list(map(int, r)) for r in box["value"]]


# --------------------------------------------------------------------------- group choice

_twins: dict = {}
_twins_lock = threading.Lock()


def _is_gloo(group) -> bool:
    import torch.distributed as dist

    try:
        return "gloo" in str(dist.get_backend(group)).lower()
    except Exception:
        return False


def _gloo_twin(group, timeout_s: float, label: str) -> TorchGroupChannel:
    """A gloo group over the same ranks as ``group`` (None = WORLD), made once per rank set."""
    import torch.distributed as dist

    target = group if group is not None else dist.group.WORLD
    if _is_gloo(target):
        return TorchGroupChannel(target, label)
    ranks = tuple(dist.get_process_group_ranks(target))
    with _twins_lock:
        twin = _twins.get(ranks)
    if twin is None:
        twin = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                              timeout=datetime.timedelta(seconds=timeout_s))
        with _twins_lock:
            _twins[ranks] = twin
        logger.debug("%s made a gloo group for the vote over ranks %s", rank_tag(), list(ranks))
    return TorchGroupChannel(twin, f"gloo twin of {label}")


def choose_channel(*, group, comm_backend, uses_comm_backend: bool, timeout_s: float) -> Channel:
    """The CPU channel over exactly the ranks that will create the workspace.

    ``uses_comm_backend``: FlashInfer will exchange through ``comm_backend`` (or, when it
    is None, through ``group``/WORLD). Order: the comm backend's gloo ``_cpu_group``
    (SGLang), ``group`` if gloo (vLLM >= 0.28), the comm backend's torch group
    (``TorchDistBackend._group``) if gloo, a cached gloo twin of whichever group
    FlashInfer will use, then the comm backend's own ``allgather``.
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if comm_backend is not None and uses_comm_backend:
        cpu_group = getattr(comm_backend, "_cpu_group", None)
        if initialised and cpu_group is not None and _is_gloo(cpu_group):
            return TorchGroupChannel(cpu_group, "comm_backend._cpu_group")
        if initialised and hasattr(comm_backend, "_group"):
            inner = getattr(comm_backend, "_group")
            if inner is not None and _is_gloo(inner):
                return TorchGroupChannel(inner, "comm_backend._group")
            return _gloo_twin(inner, timeout_s, "comm_backend._group" if inner is not None else "WORLD")
        return CommBackendChannel(comm_backend, type(comm_backend).__name__)
    if not initialised:  # legacy single-process or MPI-launched use: decide locally
        logger.info("%s torch.distributed is not initialised: deciding locally, no vote",
                    rank_tag())
        return LocalChannel(NO_PROCESS_GROUP)
    if group is not None and _is_gloo(group):
        return TorchGroupChannel(group, "group")
    return _gloo_twin(group, timeout_s, "group" if group is not None else "WORLD")


# --------------------------------------------------------------------------- the vote


@dataclasses.dataclass
class VoteResult:
    passed: bool
    records: list  # one per rank (empty on timeout)
    no_ranks: tuple = ()  # positions that said no
    digest_mismatch: tuple = ()  # positions whose digest differs from the majority
    stale: tuple = ()  # positions whose deadline had passed
    missing: str = ""  # why the vote itself failed (timeout, dead peer)
    elapsed_s: float = 0.0
    absent: tuple = ()  # ranks that never reached a vote that timed out (when known)


def vote(channel: Channel, *, ok: bool, digest: int, timeout_s: float, **numbers: int) -> VoteResult:
    start = time.time()
    deadline_ms = int((start + timeout_s) * 1000)
    record = make_record(ok=int(bool(ok)), digest=digest, deadline_ms=deadline_ms, **numbers)
    try:
        records = channel.gather(record, timeout_s)
    except VoteTimeout as exc:
        return VoteResult(False, [], missing=str(exc), elapsed_s=time.time() - start,
                          absent=tuple(exc.absent))
    now_ms = int(time.time() * 1000)
    margin_ms = int(min(1.0, 0.1 * timeout_s) * 1000)
    bad_magic = tuple(i for i, r in enumerate(records) if field(r, "magic") != MAGIC)
    if bad_magic:
        return VoteResult(False, records, missing=f"malformed records from positions {bad_magic}",
                          elapsed_s=time.time() - start)
    no = tuple(i for i, r in enumerate(records) if not field(r, "ok"))
    digests = [field(r, "digest") for r in records]
    known = [d for d in digests if d]  # 0: this rank could not plan (it says no anyway)
    common = max(sorted(set(known)), key=known.count) if known else 0
    mismatch = tuple(i for i, d in enumerate(digests) if d and d != common)
    stale = tuple(i for i, r in enumerate(records) if now_ms > field(r, "deadline_ms") - margin_ms)
    # the AND of every rank's yes bit, gated on agreement and freshness
    band = 1
    for r in records:
        band &= field(r, "ok")
    passed = bool(band) and not mismatch and not stale
    if stale and isinstance(channel, TorchGroupChannel):
        channel.poison()  # a peer gave up on this group
    return VoteResult(passed, records, no, mismatch, stale, elapsed_s=time.time() - start)


def agree_all(channel: Channel, value: bool, timeout_s: float) -> bool:
    """AND of one bit over the channel (FlashInfer's auto multicast vote, mirrored)."""
    result = vote(channel, ok=value, digest=0, timeout_s=timeout_s)
    if result.missing:
        raise VoteTimeout(result.missing, result.absent)
    return result.passed
