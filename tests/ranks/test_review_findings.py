"""Adversarial review of main (146b217) after the agreement rewrite and the issue 23 fixes.

Findings would be reproduced here as xfail(strict=True) tests; none of the attempts below
broke the promise, so this file keeps the two real-rank attempts the fault matrix did not
cover, as regression tests: real gloo ranks, the installed FlashInfer, the simulated device.
"""

import faults
from harness import results, run_ranks

STALE_BOARD = faults.COMMON + """
dev = rank_lib.setup(free_mb=None, vote_timeout=T)
seq = []
for i, tok in enumerate([2048, 1024, 1024, 512, 2048]):
    dist.barrier()
    if RANK == i % 2:  # late by turns: the peer waits and reads this rank's board meanwhile,
        time.sleep(0.6)  # which still shows its previous (completed) round as "wait"
    seq.append(rank_lib.create(rank=RANK, max_token_num=tok)[0])
result.update(seq=seq)
"""


def test_a_peers_board_left_at_a_completed_round_is_not_taken_for_a_mismatch():
    """A completed round leaves its rank's board entry at state "wait" (``_finish`` marks
    it done only for an incomplete round). A peer waiting in the next call reads it from
    BOARD_AFTER_S on; it must not abort that call as a mismatch: every call, equal or
    not to the previous one, is created on both ranks."""
    out = results(run_ranks(2, STALE_BOARD, env={"FIWS_T": str(faults.LONG_T)}, timeout=120))
    for r in out:
        assert r["seq"] == ["created"] * 5, out


ACKED_THEN_STOPPED = faults.COMMON + faults._free() + """
dev = rank_lib.setup(free_mb=FREE, vote_timeout=T)
dist.barrier()
if RANK == 0:
    rank_lib.at("round.published", lambda: mark("published-0"))
    rank_lib.at("round.acked", lambda: mark("acked-0"))
elif RANK == 2:  # stopped right after its acknowledgement was added, once rank 0's was
    await_mark("published-0")
    rank_lib.at("round.published", lambda: mark("published-2"))
    rank_lib.at("round.acked", rank_lib.once(lambda: (await_mark("acked-0"), rank_lib.stop_self())))
else:  # the last to publish: the proposer
    await_mark("published-0", "published-2")
outcome, secs, err = rank_lib.create(rank=RANK, world_size=3)
if RANK == 1:  # resume rank 2 once the proposer has answered and its deadline has passed
    pid2 = peer_pid(2)
    result["stopped"] = rank_lib.wait_stopped(pid2)
    time.sleep(T + 1.0)
    os.kill(pid2, signal.SIGCONT)
result.update(outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls), live=dev.live_bytes)
mark(f"end-{RANK}")
if RANK == 0:  # the store host stays up until every rank is done
    await_mark("end-1", "end-2")
"""


def test_an_acknowledger_stopped_after_its_add_agrees_with_the_others():
    """Three ranks; a waiting rank is stopped at ``round.acked`` (its acknowledgement in,
    the commit not written by it) and resumed after the vote timeout. Whichever of the
    two acknowledgements completed the count, the three answers agree, the running ranks
    answer within the bound, and nothing is held (the fault matrix never uses
    ``round.acked``)."""
    runs = run_ranks(3, ACKED_THEN_STOPPED, env={"FIWS_T": "2", "FIWS_LINGER_S": "1"},
                     timeout=90)
    out = results(runs)
    assert out[1]["stopped"] is True, out
    faults.all_or_none(runs, [0, 1])
    created = [r["calls"] > 0 for r in out]
    assert all(created) or not any(created), out
    assert out[2]["live"] == 0, out


def test_wait_get_outlives_a_read_a_delete_and_another_write_of_the_store():
    """``ops.wait_get`` on a real TCPStore: a peer's ``get_if`` of the awaited key, a delete
    of it and a write of another key wake the store's ``get`` with nothing; the wait goes on
    and returns the value written later, and a key never written ends at ``until``."""
    import datetime
    import threading
    import time

    from torch.distributed import TCPStore

    from flashinfer_safe_workspace.agreement import ops

    t = datetime.timedelta(seconds=10)
    host = TCPStore("127.0.0.1", 0, None, True, timeout=t, wait_for_workers=False)
    a = TCPStore("127.0.0.1", host.port, None, False, timeout=t)
    b = TCPStore("127.0.0.1", host.port, None, False, timeout=t)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(
        v=ops.wait_get(a, "k", time.monotonic() + 5.0)), daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert ops.get_if(b, "k") is None
    time.sleep(0.1)
    b.delete_key("k")
    b.compare_set("other", "", "x")
    time.sleep(0.1)
    assert waiter.is_alive()  # still waiting: nothing was written to "k"
    b.set("k", "val")
    waiter.join(5.0)
    assert got == {"v": b"val"}
    start = time.monotonic()
    assert ops.wait_get(a, "never", start + 0.3) is None
    assert time.monotonic() - start < 0.3 + 2.0
