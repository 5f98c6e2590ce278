"""Issue 23, F2 and F4: a host that destroys its default group and initialises a new one
on the same store object. Real gloo ranks, the simulated device.

- F2: the new group starts clean on the same store: a new call with equal arguments is
  created on every rank (the old group's board entries do not make it a mismatch);
- F4: over 50 re-inits (each a new group on a new store) and 500 calls, every group ends
  with the ``fiws-store`` threads and the store keys the first group had after the same
  calls (nothing grows per re-init or call);
- F4, within one group: rounds a rank never joins (calls only its peer made, its calls out
  of step) keep their keys only until a later round shows every rank came: the leftovers
  go (``agreement/driver.py``, ``core.sweep``).
"""

import faults
from harness import results, run_ranks

SAME_STORE = faults.COMMON + """
import datetime, threading, harness
from torch.distributed import TCPStore
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
port = int(STORE.get("port2")) if RANK else harness.free_port()
if RANK == 0:
    STORE.set("port2", str(port))
dist.barrier()
dist.destroy_process_group()
del STORE
S = TCPStore("127.0.0.1", port, WORLD, RANK == 0, timeout=datetime.timedelta(seconds=30))
def world():
    dist.init_process_group("gloo", store=S, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
def again(i):
    # gloo's own rendezvous keys of the old group would hand a rank its peer's old address:
    # the test removes them (the host's business, not the shim's) before the new group
    dist.barrier()
    dist.destroy_process_group()
    S.set(f"test/left/{i}/{RANK}", "1")
    S.wait([f"test/left/{i}/{r}" for r in range(WORLD)])
    if RANK == 0:
        for r in range(WORLD):
            S.delete_key(f"0//cpu//0/{r}")
        S.set(f"test/clean/{i}", "1")
    S.wait([f"test/clean/{i}"])
    world()
"""

F2_BODY = SAME_STORE + """
world()
first = [rank_lib.create(rank=RANK)[0]]
if RANK == 1:
    first.append(rank_lib.create(rank=RANK, max_token_num=1024)[0])
    first.append(rank_lib.create(rank=RANK, max_token_num=512)[0])
else:
    first.append(rank_lib.create(rank=RANK, max_token_num=1024)[0])
again(1)
if RANK == 1:
    time.sleep(0.5)  # rank 0 waits in its round and reads rank 1's board meanwhile
outcome, secs, err = rank_lib.create(rank=RANK, max_token_num=256)
result.update(first=first, outcome=outcome, secs=secs, err=err, reasons=rank_lib.last_reasons)
dist.barrier()
dist.destroy_process_group()
"""


def test_new_group_on_the_same_store_starts_clean():
    """Rank 1 made one more call than rank 0 in the old group; in the new group an equal
    call is created on both ranks (714be8f: vetoed on both as a mismatch)."""
    out = results(run_ranks(2, F2_BODY, env={"FIWS_T": "3"}, timeout=90))
    for r in out:
        assert r["outcome"] == "created", out
        assert r["secs"] <= faults.bound(r["t"]), out  # its own vote timeout (3 s), not 2 s


STALE_BODY = SAME_STORE + """
world()
first = rank_lib.create(rank=RANK, max_token_num=512)[0]  # both: created
if RANK == 1:  # a call only rank 1 makes in the first group: vetoed at its timeout, and its
    # round's abort stays in the store (rank 0 never comes to it)
    alone = rank_lib.create(rank=RANK, max_token_num=768)[0]
again(1)  # a new group on the same store, in the same processes
got = [rank_lib.create(rank=RANK, max_token_num=768) for _ in range(2)]
result.update(got=[(g[0], g[1]) for g in got], outcome=got[-1][0], secs=got[-1][1], err=got[-1][2],
              reasons=rank_lib.last_reasons)
dist.barrier()
dist.destroy_process_group()
"""


def test_an_old_group_s_abort_on_the_same_store_does_not_reach_the_new_group():
    """7c21911: the first group's abort of a call was followed in the new group (its round
    had the same name there), and cached: every later identical call was refused in 0.000 s
    until install(). The new group's rounds carry its own generation: created on both.
    (Every rank made a call in the first group: docs/agreement.md says why it must.)"""
    out = results(run_ranks(2, STALE_BODY, env={"FIWS_T": "1.5"}, timeout=120))
    for r in out:
        assert [g[0] for g in r["got"]] == ["created", "created"], out


LEAK_BODY = faults.COMMON + """
import datetime, threading, harness
from flashinfer_safe_workspace.agreement import store as _line_of
CTL = STORE  # the first group's store stays up: it hands each new group's port round
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
def store_threads():
    return sum(t.name == "fiws-store" for t in threading.enumerate())
calls = 0
def some_calls(i):
    global calls
    outs = []
    for k in range(8):  # healthy calls, a new shape each
        calls += 1; outs.append(rank_lib.create(rank=RANK, max_token_num=64 + 8 * (i * 8 + k))[0])
    # a veto: rank 0 short for this shape (cached on both), then the same call again
    dev.free_bytes = (rank_lib.need_mb() - 2) * rank_lib.MiB if RANK == 0 else 80 << 30
    calls += 2; outs += [rank_lib.create(rank=RANK)[0], rank_lib.create(rank=RANK)[0]]
    seen.append(outs)
    dev.free_bytes = 80 << 30
    # once every rank's queued clean-ups have run (each line is first in, first out: the
    # count-outs and deletions of a round run on its rank set's waiting line, a cached
    # veto's on the first line)
    _line_of.line(T).call(lambda s: None, time.monotonic() + 60)
    _line_of.waiter(T, "0-1").call(lambda s: None, time.monotonic() + 60)
    _line_of.line(T).call(lambda s: None, time.monotonic() + 60)
    dist.barrier()
    n = dist.distributed_c10d._get_default_store().num_keys() if RANK == 0 else -1
    dist.barrier()
    return n
counts, seen = [], []
for i in range(int(os.environ.get("FIWS_WORLDS", "50"))):
    if RANK == 0:
        CTL.set(f"port/{i}", str(harness.free_port()))
    port = int(CTL.get(f"port/{i}"))
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    keys = some_calls(i)
    counts.append((store_threads(), keys))
dist.barrier()
result.update(counts=counts, calls=calls, live=dev.live_bytes, seen=seen)
"""


def _leak_runs():
    # the long vote timeout (no call here is meant to wait one out): on a loaded machine a
    # healthy call vetoed at a short one leaves its round to the later removal (leftovers),
    # after this group's count
    return results(run_ranks(2, LEAK_BODY, env={"FIWS_T": str(faults.LONG_T)}, timeout=600))


def test_fifty_reinits_and_five_hundred_calls_hold_the_store_threads():
    """714be8f: 2 ``fiws-store`` threads more after every re-init (2, 4, ... 100)."""
    out = _leak_runs()
    for r in out:
        assert r["calls"] == 500, r
        assert r["live"] == 0, r
        threads = [t for t, _ in r["counts"]]
        assert set(threads) == {threads[0]}, r["counts"]
    keys = [k for _, k in out[0]["counts"]]  # each group's own store, after its 10 calls
    odd = [f"group {i}: {k} keys; rank 0 {out[0]['seen'][i]}; rank 1 {out[1]['seen'][i]}"
           for i, k in enumerate(keys) if k != keys[0]]
    assert set(keys) == {keys[0]}, odd


REAP_BODY = faults.COMMON + """
from flashinfer_safe_workspace.agreement import store as _line_of
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
def keys():  # once every rank's queued clean-ups have run (each line is first in, first
    # out: a round's count-outs and deletions run on its rank set's waiting line)
    _line_of.line(T).call(lambda s: None, time.monotonic() + 60)
    _line_of.waiter(T, "0-1").call(lambda s: None, time.monotonic() + 60)
    _line_of.line(T).call(lambda s: None, time.monotonic() + 60)
    dist.barrier()
    n = STORE.num_keys() if RANK == 0 else -1
    dist.barrier()
    return n
for k in range(3):  # healthy calls: what every rank set keeps (the group's generation)
    rank_lib.create(rank=RANK, max_token_num=64 + 8 * k)
base = keys()
skewed = []
if RANK == 1:  # calls rank 0 has not made yet: rank 1 alone in their rounds, each vetoed at
    # its vote timeout, and left behind
    skewed = [rank_lib.create(rank=RANK, max_token_num=1000 + k)[0] for k in range(5)]
left = keys()  # rank 0 waits in keys() meanwhile
caught = []
if RANK == 0:  # the same calls, late: each round's abort is there already (its count-out
    # deletes the round)
    caught = [rank_lib.create(rank=RANK, max_token_num=1000 + k)[:2] for k in range(5)]
after = [rank_lib.create(rank=RANK, max_token_num=512 + 8 * k)[0] for k in range(5)]
end = keys()  # in step again: the first complete round swept what rank 1 left behind
result.update(base=base, left=left, end=end, skewed=skewed, caught=caught, after=after,
              live=dev.live_bytes)
"""


def test_rounds_a_rank_never_joins_are_removed_later():
    """F4: rounds only rank 1 had opened kept their keys (15-34 keys at 714be8f against 5);
    once rank 0 has caught up (its late calls follow the aborts there at once) and a later
    round shows every rank came, the leftovers go: the store ends with the keys it had
    before them, and the calls in step are created."""
    out = results(run_ranks(2, REAP_BODY, env={"FIWS_T": "1.5"}, timeout=180))
    r0, r1 = out
    assert r1["skewed"] == ["none"] * 5, r1
    assert [c[0] for c in r0["caught"]] == ["none"] * 5, r0
    assert all(c[1] < r0["t"] for c in r0["caught"]), r0  # at once: the aborts were there
    assert r0["after"] == r1["after"] == ["created"] * 5, out
    assert r0["left"] > r0["base"], r0  # the skewed rounds' keys were there
    assert r0["end"] == r0["base"], r0
    assert r0["live"] == r1["live"] == 0, out
