"""The veto WARNING's first sentence (``agreement.explain.headline``): which rank failed, why,
and what every rank now does, from a ``VetoInfo`` alone. Two real ranks write it in
tests/ranks/test_logs.py; these cases cover the shapes those runs do not reach."""

from __future__ import annotations

from types import SimpleNamespace

from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace import _veto as explain
from flashinfer_safe_workspace.agreement.record import NO, Candidate, Record
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


def test_shortfall_of_a_rank_s_own_no_and_of_a_decided_abort_it_followed():
    own = _oom(1, 1, free=120 * MiB)
    outcome = SimpleNamespace(verdict=None, records=None, register=None)
    assert explain._shortfalls(outcome, own) == ((1, 1, 44 * MiB),)
    # a rank that followed an abort decided before it arrived, or did not read every record,
    # has only the register's text, which describe() wrote on the rank that said no: the
    # rank and device, no figure
    why = "; ".join(explain.describe(own, c) for c in own.candidates.values())
    followed = SimpleNamespace(verdict=None, records=None,
                               register=SimpleNamespace(why=why, commit=False))
    assert explain._shortfalls(followed, None) == ((1, 1, -1),)
    assert explain.headline(info(reasons={R.OUT_OF_MEMORY},
                                 short=explain._shortfalls(followed, None))).startswith(
        "rank 1 ran out of GPU memory on cuda:1, so no rank created")
