"""mnnvl-cutedsl (allocator D, FlashInfer 0.7.4): the rules' own words for it. Each buffer's
name and formula and the notes (``Plan.describe()``) for an LL/BT/HT plan, a plan without
the norm (its gamma placeholder and the LL two-shot buffers) and an FP8-output plan; the
note a peer without multicast adds; the reason of each call FlashInfer rejects itself.
The sizes are FlashInfer's (test_release_table.py compares every byte of the conformance
grid's cutedsl cases with FlashInfer's own code); the words are pinned here as written.
The rules read FlashInfer's profile tables: skipped where 0.7.4's are not importable."""

from __future__ import annotations

import dataclasses

import pytest

from flashinfer_safe_workspace.planning import rules
from flashinfer_safe_workspace.planning.plan import MiB, Facts, PassThrough, Request, Unplanned
from flashinfer_safe_workspace.planning.rules import plan_for

R = dataclasses.replace
G2 = Facts(granularity=2 * MiB, multicast_granularity=2 * MiB)
BLACKWELL = R(G2, compute_capability=(10, 0))
EXACT = R(BLACKWELL, granularity=1, torch_signal_pad=9216)


def cutedsl(**kw) -> Request:
    args = dict(entry="unified", backend="mnnvl-cutedsl", world_size=8, rank=0,
                max_token_num=2048, hidden_dim=8192, dtype="bfloat16")
    args.update(kw)
    return Request(**args)


@pytest.fixture(autouse=True)
def _flashinfer_0_7_4():
    flashinfer = pytest.importorskip("flashinfer")
    pytest.importorskip("flashinfer.comm.mnnvl_cutedsl")
    if rules.parse_version(flashinfer.__version__)[:3] != (0, 7, 4):
        pytest.skip(f"D is planned for 0.7.4; {flashinfer.__version__} is installed")


DESCRIBE = [  # (call, facts) -> the plan's world size, dtype and description
    (cutedsl(cutedsl_options=(("top_k", "10"),)), EXACT, 8, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend mnnvl-cutedsl, allocator D, handle posix, device current\n'
     '  cutedsl.ll.mailbox            8.634 MiB  cuMemCreate RU(RU(3*ws*23*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ll.mailbox.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.mailbox.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.stage_state        0.000 MiB  torch       int32[2]\n'
     '  cutedsl.bt.contribution       48.009 MiB  cuMemCreate RU(RU(3*ws*ceil(1024/ws)*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.contribution.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.prenorm           48.009 MiB  cuMemCreate RU(RU(3*1024*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.prenorm.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.stage_state        0.000 MiB  torch       int32[6]\n'
     '  cutedsl.ht.routed_ready        0.010 MiB  cuMemCreate RU(RU(ceil(2048/ws)*4, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ht.routed_ready.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.routed_ready.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.routed_ready.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.ht.routed_processed        0.008 MiB  torch       uint32[ceil(2048/ws), ws]\n'
     '  cutedsl.ht.all_reduce_ready        0.010 MiB  cuMemCreate RU(RU(ceil(2048/ws)*4, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ht.all_reduce_ready.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.all_reduce_ready.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.all_reduce_ready.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.ht.all_reduce_processed        0.008 MiB  torch       uint32[ceil(2048/ws), ws]\n'
     '  cutedsl.ht.local             32.009 MiB  cuMemCreate RU(RU(2048*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ht.local.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.local.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.prenorm           32.009 MiB  cuMemCreate RU(RU(2048*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ht.prenorm.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ht.prenorm.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  peak held                   168.705 MiB\n'
     '  note: capacities LL=23 BT=1024 HT=2048 (FlashInfer 0.7.4 profile tp=8 H=8192 top_k=10 cc=(10, 0))'),
    (cutedsl(world_size=4, rank=3, max_token_num=300, cutedsl_options=(("top_k", "10"), ("apply_rms_norm", "False"))), R(EXACT, compute_capability=(10, 7)), 4, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend mnnvl-cutedsl, allocator D, handle posix, device current\n'
     '  cutedsl.gamma_placeholder        0.016 MiB  torch       bf16[H]\n'
     '  cutedsl.ll.mailbox           56.259 MiB  cuMemCreate RU(RU(3*ws*300*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ll.mailbox.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.mailbox.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.mailbox.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.ll.stage_state        0.000 MiB  torch       int32[2]\n'
     '  cutedsl.ll.two_shot.scatter       56.259 MiB  cuMemCreate RU(RU(3*ws*300*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ll.two_shot.scatter.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.two_shot.scatter.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.two_shot.scatter.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.ll.two_shot.gather       14.071 MiB  cuMemCreate RU(RU(3*300*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ll.two_shot.gather.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.two_shot.gather.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.two_shot.generations        0.009 MiB  torch       int32[300*8]\n'
     '  cutedsl.bt.contribution       14.071 MiB  cuMemCreate RU(RU(3*ws*ceil(300/ws)*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.contribution.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.prenorm           14.071 MiB  cuMemCreate RU(RU(3*300*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.prenorm.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.stage_state        0.000 MiB  torch       int32[6]\n'
     '  peak held                   154.757 MiB\n'
     '  note: capacities LL=300 BT=300 HT=None (FlashInfer 0.7.4 profile tp=4 H=8192 top_k=10 cc=(10, 7))'),
    (cutedsl(world_size=16, rank=5, max_token_num=20, cutedsl_options=(("top_k", "10"), ("output_dtype", "torch.float8_e4m3fn"), ("dynamic_fp8", "True"), ("write_norm_output", "True"))), EXACT, 16, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend mnnvl-cutedsl, allocator D, handle posix, device current\n'
     '  cutedsl.ll.mailbox            5.259 MiB  cuMemCreate RU(RU(3*ws*7*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.ll.mailbox.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.mailbox.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.ll.stage_state        0.000 MiB  torch       int32[2]\n'
     '  cutedsl.bt.contribution        1.509 MiB  cuMemCreate RU(RU(3*ws*ceil(20/ws)*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.contribution.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.contribution.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.prenorm            0.946 MiB  cuMemCreate RU(RU(3*20*H*2, 16) + P_t=9216, G=1)\n'
     '  cutedsl.bt.prenorm.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  cutedsl.bt.prenorm.peer_addresses        0.000 MiB  torch       int64[ws]\n'
     '  cutedsl.bt.stage_state        0.000 MiB  torch       int32[6]\n'
     '  peak held                     7.715 MiB\n'
     '  note: capacities LL=7 BT=20 HT=None (FlashInfer 0.7.4 profile tp=16 H=8192 top_k=10 cc=(10, 0))'),
]

REJECTIONS = [  # (call, facts) -> PassThrough (FlashInfer raises) or Unplanned
    (cutedsl(world_size=6), BLACKWELL,
     PassThrough('mnnvl-cutedsl needs tp_size 2, 4, 8 or 16 (FlashInfer ValueError)')),
    (cutedsl(dtype="float16"), BLACKWELL,
     PassThrough('mnnvl-cutedsl supports bfloat16 only (FlashInfer ValueError)')),
    (cutedsl(gpus_per_node=8), BLACKWELL,
     PassThrough("backend='mnnvl-cutedsl' does not use: gpus_per_node (FlashInfer ValueError)")),
    (cutedsl(has_comm_backend=True), BLACKWELL,
     PassThrough("backend='mnnvl-cutedsl' does not use: comm_backend (FlashInfer ValueError)")),
    (cutedsl(force_oneshot_support=True), BLACKWELL,
     PassThrough("backend='mnnvl-cutedsl' does not use: force_oneshot_support (FlashInfer ValueError)")),
    (cutedsl(rank=8), BLACKWELL,
     PassThrough('mnnvl-cutedsl tp_rank out of range (FlashInfer ValueError)')),
    (cutedsl(cutedsl_options=(("apply_rms_norm", "False"), ("write_residual_output", "False"))), BLACKWELL,
     PassThrough('mnnvl-cutedsl without the norm needs write_residual_output (FlashInfer ValueError)')),
    (cutedsl(cutedsl_options=(("output_dtype", "torch.float16"),)), BLACKWELL,
     PassThrough('mnnvl-cutedsl output_dtype must be bfloat16 or float8_e4m3fn (FlashInfer ValueError)')),
    (cutedsl(cutedsl_options=(("dynamic_fp8", "True"),)), BLACKWELL,
     PassThrough('inconsistent mnnvl-cutedsl output options (FlashInfer ValueError)')),
    (cutedsl(cutedsl_options=(("write_norm_output", "True"),)), BLACKWELL,
     PassThrough('inconsistent mnnvl-cutedsl output options (FlashInfer ValueError)')),
    (cutedsl(cutedsl_options=(("apply_rms_norm", "False"), ("output_dtype", "torch.float8_e4m3fn"))), BLACKWELL,
     PassThrough('inconsistent mnnvl-cutedsl output options (FlashInfer ValueError)')),
    (cutedsl(), G2,
     PassThrough('mnnvl-cutedsl needs a Blackwell GPU (FlashInfer RuntimeError)')),
    (cutedsl(), R(BLACKWELL, multicast_supported=False),
     PassThrough('mnnvl-cutedsl needs NVLink multicast (FlashInfer RuntimeError)')),
    (cutedsl(cutedsl_options=(("top_k", "x"),)), BLACKWELL,
     Unplanned('mnnvl-cutedsl top_k=x: not an int')),
    (cutedsl(hidden_dim=4096), BLACKWELL,
     PassThrough('mnnvl-cutedsl: No MNNVL CuTe DSL profile supports this static shape (FlashInfer ValueError)')),
]


@pytest.mark.parametrize("req,facts,world_size,dtype,text", DESCRIBE)
def test_the_cutedsl_plan_describes_itself(req, facts, world_size, dtype, text):
    plan = plan_for(req, facts, "0.7.4")
    assert (plan.world_size, plan.dtype) == (world_size, dtype)
    assert plan.describe() == text


def test_a_peer_without_multicast_is_noted():
    req = DESCRIBE[0][0]
    alone = plan_for(req, EXACT, "0.7.4")
    plan = plan_for(req, R(EXACT, multicast_all_ranks=False), "0.7.4")
    assert plan.allocations == alone.allocations
    assert plan.notes == alone.notes + (
        "a peer lacks multicast: torch leaves the multicast pointer 0 and FlashInfer "
        "raises RuntimeError after the first multicast buffer",)


@pytest.mark.parametrize("req,facts,expected", REJECTIONS)
def test_the_reason_of_each_cutedsl_rejection(req, facts, expected):
    if isinstance(expected, Unplanned):
        with pytest.raises(Unplanned) as err:
            plan_for(req, facts, "0.7.4")
        assert str(err.value) == str(expected)
    else:
        assert plan_for(req, facts, "0.7.4") == expected
