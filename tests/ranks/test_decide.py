"""The real vote and decision over real multi-process gloo groups, on a simulated device."""

from __future__ import annotations

import pytest

from faults import LONG_T
from harness import results, run_ranks

# The vote timeout of every test here: no rank is meant to wait it out, so a decision that
# ends before it did not wait for anyone (``secs < T``), also on a loaded machine; one that
# waited for a rank that never comes would take T at least, and say ABSENT.
T = LONG_T
OOM = ["OUT_OF_MEMORY"]


def told(reasons, code=OOM):
    """A peer of the rank that said no: it saw that rank's record (the same code), or arrived
    after the abort was written and followed it (ABORTED)."""
    return reasons in (code, ["ABORTED"])


def test_all_fit_calls_flashinfer_once_on_every_rank():
    runs = run_ranks(2, """
        import rank_lib
        rank_lib.setup(free_mb=None, vote_timeout=%r)
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls))
        result.update(report=rank_lib.last_decision())
    """ % T)
    for r in results(runs):
        assert r["outcome"] == "created", r
        assert r["calls"] == 1
        assert r["report"]["outcome"] == "pass" and r["report"]["ranks"] == [0, 1]
        assert r["secs"] < T, r


@pytest.mark.parametrize("on_veto", ["none", "raise"])
def test_one_rank_short_vetoes_on_every_rank(on_veto):
    runs = run_ranks(2, f"""
        import rank_lib
        need = rank_lib.need_mb()
        rank_lib.setup(free_mb=need - 2 if RANK == 0 else None, on_veto="{on_veto}", vote_timeout={T})
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls))
    """)
    for r in results(runs):
        assert r["calls"] == 0, r  # FlashInfer entered on no rank
        assert r["outcome"] == ("none" if on_veto == "none" else "vetoed"), r
        assert r["reasons"] == OOM if r["rank"] == 0 else told(r["reasons"]), r
        assert r["secs"] < T, r
        if on_veto == "raise":
            assert "rank 0" in r["err"] and "OUT_OF_MEMORY" in r["err"]
            assert "multicast" not in r["err"].lower()


def test_exact_boundary_plan_plus_headroom():
    """free == plan peak + headroom passes; one granule less is vetoed."""
    body = """
        import rank_lib
        need = rank_lib.need_mb(headroom_mb=64)
        rank_lib.setup(free_mb=need + DELTA if RANK == 1 else None, headroom_mb=64)
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(reasons=rank_lib.last_reasons, outcome=outcome, calls=len(rank_lib.calls))
    """
    ok = results(run_ranks(2, body.replace("DELTA", "0")))
    short = results(run_ranks(2, body.replace("DELTA", "-2")))
    assert [r["outcome"] for r in ok] == ["created", "created"]
    assert [r["outcome"] for r in short] == ["none", "none"]
    assert [r["reasons"] for r in ok] == [[], []]
    assert told(short[0]["reasons"]) and short[1]["reasons"] == OOM, short


def test_four_ranks_one_short():
    runs = run_ranks(4, """
        import rank_lib
        need = rank_lib.need_mb(world_size=4)
        rank_lib.setup(free_mb=need - 100 if RANK == 2 else None, on_veto="raise")
        outcome, secs, err = rank_lib.create(rank=RANK, world_size=4)
        result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, err=err, calls=len(rank_lib.calls))
    """, timeout=120)
    rs = results(runs)
    assert [r["outcome"] for r in rs] == ["vetoed"] * 4
    assert all(r["calls"] == 0 for r in rs)
    assert all("rank 2 (cuda:0)" in r["err"] for r in rs)
    assert rs[2]["reasons"] == OOM and all(told(rs[r]["reasons"]) for r in (0, 1, 3)), rs


def test_subgroup_of_four_votes_without_the_other_ranks():
    """Ranks 0,1 create over a 2-rank NCCL-like subgroup (here gloo); ranks 2,3 are busy
    elsewhere and never call: they stay busy until ranks 0 and 1 have answered. The vote
    must only involve ranks 0 and 1: it answers before the vote timeout (a vote over WORLD
    would wait it out, then name ranks 2 and 3 as absent)."""
    runs = run_ranks(4, """
        import datetime
        import rank_lib
        import torch.distributed as dist
        store = dist.distributed_c10d._get_default_store()
        sub = dist.new_group([0, 1], backend="gloo")
        if RANK in (0, 1):
            need = rank_lib.need_mb()
            rank_lib.setup(free_mb=need - 10 if RANK == 1 else None, vote_timeout=%(T)r)
            outcome, secs, err = rank_lib.create(rank=RANK, group=sub)
            result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs,
                          ranks=rank_lib.last_decision()["ranks"])
            store.set(f"answered/{RANK}", "1")
        else:  # busy, never joins: until both members have answered (bounded)
            store.wait(["answered/0", "answered/1"], datetime.timedelta(seconds=2 * %(T)r + 30))
            result.update(outcome="busy")
    """ % {"T": T}, timeout=2 * T + 90)
    rs = results(runs)
    assert rs[0]["outcome"] == rs[1]["outcome"] == "none", rs
    assert told(rs[0]["reasons"]) and rs[1]["reasons"] == OOM, rs
    assert rs[0]["ranks"] == rs[1]["ranks"] == [0, 1], rs
    assert rs[0]["secs"] < T and rs[1]["secs"] < T, rs  # did not wait for ranks 2 and 3
    assert rs[2]["outcome"] == rs[3]["outcome"] == "busy", rs


def test_veto_is_cached_without_a_new_collective():
    runs = run_ranks(2, """
        import rank_lib
        need = rank_lib.need_mb()
        dev = rank_lib.setup(free_mb=need - 2 if RANK == 0 else None, vote_timeout=%r)
        first = rank_lib.create(rank=RANK)
        probes = dev.probes
        # rank 1 alone asks again: a collective would block; the cache answers at once
        second = rank_lib.create(rank=RANK) if RANK == 1 else first
        result.update(first=first[0], second=second[0], second_secs=second[1],
                      probes_before=probes, probes_after=dev.probes, live=dev.live_bytes,
                      reasons=rank_lib.last_reasons)
    """ % T)
    rs = results(runs)
    assert [r["first"] for r in rs] == ["none", "none"]
    # answered from the cache: no probe, no decision line, before the vote timeout (a
    # round would wait it out for rank 0, which never asks again)
    assert rs[1]["second"] == "none" and rs[1]["second_secs"] < T, rs
    assert rs[1]["reasons"] is None, rs
    assert rs[1]["probes_after"] == rs[1]["probes_before"]
    assert all(r["live"] == 0 for r in rs)


def test_comm_backend_group_is_used_for_the_vote():
    """vLLM/LightLLM pass comm_backend=TorchDistBackend(group): the ranks that decide are that
    group's, not WORLD's (ranks 2 and 3 of a 4-rank world create over [2, 3]; 0 and 1 never
    call, so a vote over WORLD would time out)."""
    runs = run_ranks(4, """
        import rank_lib
        from flashinfer.comm.comm_backend import TorchDistBackend
        import torch.distributed as dist
        g = dist.new_group([2, 3], backend="gloo")
        if RANK >= 2:
            need = rank_lib.need_mb()
            rank_lib.setup(free_mb=need - 2 if RANK == 3 else None, vote_timeout=%(T)r)
            outcome, secs, err = rank_lib.create(rank=RANK - 2, comm_backend=TorchDistBackend(g))
            result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, ranks=rank_lib.last_decision()["ranks"])
        else:
            result.update(outcome="idle", secs=0.0, ranks=None)
    """ % {"T": T}, timeout=T + 90)
    rs = results(runs)
    assert [r["outcome"] for r in rs[2:]] == ["none", "none"]
    assert told(rs[2]["reasons"]) and rs[3]["reasons"] == OOM, rs
    assert rs[2]["ranks"] == rs[3]["ranks"] == [2, 3]
    assert rs[2]["secs"] < T and rs[3]["secs"] < T, rs  # a vote over WORLD would wait it out


def test_world_size_one_on_a_group_of_one_decides_alone():
    """A per-rank workspace over a group of one (world_size=1): no round, no waiting for
    the rank that never calls."""
    runs = run_ranks(2, """
        import rank_lib
        import torch.distributed as dist
        solo = dist.new_group([0], backend="gloo")
        if RANK == 0:
            rank_lib.setup(free_mb=None, vote_timeout=%(T)r)
            outcome, secs, err = rank_lib.create(rank=0, world_size=1, group=solo)
            result.update(reasons=rank_lib.last_reasons, outcome=outcome, secs=secs, ranks=rank_lib.last_decision()["ranks"])
        else:
            result.update(outcome="idle", secs=0.0)
    """ % {"T": T})
    rs = results(runs)
    assert rs[0]["outcome"] == "created" and rs[0]["secs"] < T, rs
    assert rs[0]["ranks"] == [0]
