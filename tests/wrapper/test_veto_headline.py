"""The veto WARNING's first sentence (``agreement.explain.headline``): which rank failed, why,
and what every rank now does, from a ``VetoInfo`` alone. Two real ranks write it in
tests/ranks/test_logs.py; these cases cover the shapes those runs do not reach."""

from __future__ import annotations

from types import SimpleNamespace

from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace import _veto as explain
from flashinfer_safe_workspace.agreement.explain import said_no, shortfalls, timed_out
from flashinfer_safe_workspace.agreement.record import NO, Candidate, Record
from flashinfer_safe_workspace.agreement.vote import Outcome
from flashinfer_safe_workspace.planning.probe import CUDA_ERROR_OUT_OF_MEMORY

MiB = 1 << 20
EVERY = (", so no rank created FlashInfer's all-reduce workspace; every rank takes the "
         "non-fused all-reduce path.")


def info(ranks=(), details=("detail",), reasons=(), short=()):
    return explain.VetoInfo("message", tuple(ranks), tuple(details), tuple(sorted(reasons)),
                            short=tuple(short))


def test_out_of_memory_names_the_rank_the_bytes_and_the_device():
    assert explain.headline(info((2,), reasons={R.OUT_OF_MEMORY}, short=[(2, 5, 82 * MiB)])) \
        == "rank 2 was 82 MiB short on cuda:5" + EVERY
    both = info((0, 1), reasons={R.OUT_OF_MEMORY, R.ABSENT},
                short=[(0, 0, 3 << 30), (1, 1, 512 * 1024)])
    assert explain.headline(both).startswith(
        "rank 0 was 3.00 GiB short on cuda:0 and rank 1 was 512 KiB short on cuda:1 "
        "(also: a rank did not answer in time), so no rank")
    # free memory not known (-1), or the allocation failed with room left: no figure
    assert explain.headline(info(reasons={R.OUT_OF_MEMORY}, short=[(3, 1, -1)])) \
        == "rank 3 ran out of GPU memory on cuda:1" + EVERY
    # torch.distributed not initialised: the record's rank is -1
    assert explain.headline(info(reasons={R.OUT_OF_MEMORY}, short=[(-1, 0, 20 * MiB)])) \
        .startswith("this rank was 20 MiB short on cuda:0, so")


def test_other_causes_in_words():
    mismatch = info((0, 1), ("max_token_num differs: 2048 on rank 0; 4096 on rank 1",
                             "hidden_dim differs: 4096 on rank 0; 8192 on rank 1"),
                    {R.ARG_MISMATCH})
    assert explain.headline(mismatch) == (
        "ranks 0 and 1 called with different arguments (max_token_num, hidden_dim)" + EVERY)
    assert explain.headline(info((1, 3, 4), reasons={R.ABSENT})) == (
        "ranks 1, 3 and 4 did not answer within the vote timeout" + EVERY)
    assert explain.headline(info((0,), reasons={R.CAPTURING})).startswith(
        "rank 0 was called during CUDA graph capture, so")
    # any other code: its words from _reasons.REASON_TEXT; no rank named: "a rank"
    assert explain.headline(info(reasons={R.FABRIC_NOT_READY})).startswith(
        f"a rank said no ({R.REASON_TEXT[R.FABRIC_NOT_READY]}), so no rank created")


def test_a_veto_this_rank_decided_alone_speaks_of_this_rank():
    text = explain.headline(explain.local("forked child: no c10d store after fork"))
    assert text == ("this rank vetoed the call on its own (forked child: no c10d store after "
                    "fork), so this rank did not create FlashInfer's all-reduce workspace; it "
                    "takes the non-fused all-reduce path.")


def test_what_every_rank_does_can_be_replaced():
    text = explain.headline(info((0,), reasons={R.CAPTURING}), then="the call raises X")
    assert text.endswith("so no rank created FlashInfer's all-reduce workspace; the call raises X.")


def test_a_broken_info_still_gives_a_sentence():
    broken = explain.VetoInfo("m", None, None, (R.ARG_MISMATCH,))
    assert explain.headline(broken).startswith("a rank said no, so no rank created")


def _oom(rank, device, free, peak=100 * MiB, headroom=64 * MiB):
    cand = Candidate(NO, R.OUT_OF_MEMORY, peak_bytes=peak, headroom_bytes=headroom,
                     device=device, free_bytes=free, failed_bytes=headroom,
                     failed_headroom=True, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    return Record(rank=rank, pid=1, position=rank, call="c", args={}, candidates={"trtllm": cand})


def _members(ranks):
    return SimpleNamespace(ranks=tuple(ranks))


def test_shortfall_of_a_rank_s_own_no_and_of_a_decided_abort_it_followed():
    own = _oom(1, 1, free=120 * MiB)
    assert shortfalls(None, [], own) == ((1, 1, 44 * MiB),)
    # a rank that followed the abort rank 1 wrote (it arrived after the decision, or did
    # not read every record) reads the figure from the register, which carries it
    reg = said_no(own)
    followed = Outcome(False, register=reg)
    got = explain.veto(followed, _members((0, 1)), None, None)
    assert got.short == ((1, 1, 44 * MiB),)
    assert explain.headline(got) == "rank 1 was 44 MiB short on cuda:1" + EVERY


def test_a_rank_s_own_shortfall_joins_the_one_that_decided():
    reg = said_no(_oom(1, 1, free=120 * MiB))
    mine = _oom(0, 0, free=100 * MiB)  # this rank lacked memory too, but rank 1 wrote first
    got = explain.veto(Outcome(False, register=reg), _members((0, 1)), None, mine)
    assert got.short == ((1, 1, 44 * MiB), (0, 0, 64 * MiB))
    assert explain.headline(got).startswith(
        "rank 1 was 44 MiB short on cuda:1 and rank 0 was 64 MiB short on cuda:0, so no rank")


def test_a_follower_of_another_rank_s_deadline_names_the_ranks_not_in():
    reg = timed_out(0, 30, "c")
    # the driver read the records: rank 2's is not in
    late = Outcome(False, register=reg, absent=(2,),
                   missing=f"{reg.why}; ranks [2] had not voted")
    got = explain.veto(late, _members((0, 1, 2)), None, None)
    assert got.ranks == (2,) and R.ABSENT in got.reasons
    assert explain.headline(got) == "rank 2 did not answer within the vote timeout" + EVERY
    # every record is in by now (the late rank came after the deadline): no rank is
    # blamed for a no it did not say; the sentence says whose deadline ended the round
    got = explain.veto(Outcome(False, register=reg), _members((0, 1, 2)), None, None)
    assert got.ranks == () and got.reasons == (R.ABORTED,)
    assert explain.headline(got) == (
        "rank 0 reached its deadline (30 s) before every rank's yes was in" + EVERY)
    assert "said no" not in explain.headline(got)


def test_in_doubt_does_not_claim_what_the_peers_did():
    doubt = Outcome(False, missing="the c10d store did not answer in time", in_doubt=True)
    got = explain.veto(doubt, _members((0, 1)), None, None)
    text = explain.headline(got)
    assert "no rank created" not in text and "cannot tell whether its peers did" in text
    assert got.message.startswith("FlashInfer all-reduce workspace not created on this rank")
    assert "did not answer: the c10d store did not answer" not in got.message


def test_messages_have_no_doubled_stop_and_tiny_sizes_have_a_figure():
    got = explain.veto(Outcome(False, register=said_no(_oom(1, 1, free=120 * MiB))),
                       _members((0, 1)), SimpleNamespace(peak_bytes=4096), None)
    assert ".." not in got.message and "(plan 4 KiB per rank)" in got.message
    assert explain._size(12) == "12 bytes"
    assert explain.headline(info((-1, 0), reasons={R.CAPTURING})).startswith(
        "this rank and rank 0 was called")
