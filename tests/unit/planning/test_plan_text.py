"""The text the rules give with a plan: each allocation's name and formula, the notes, the
plan's own fields (``Plan.describe()``, what ``fiws check`` prints and the logs carry), and
the reason of every pass-through and unplanned call (the veto's note on every rank).

These are the rules' own words, not FlashInfer's: the sizes in them are FlashInfer's
(``test_release_table.py`` pins every byte against FlashInfer's code per range); the names,
formulas and reasons are pinned here as written, one plan per allocator path (A, B1 with
its device and export failure, B2 with the MAX_COMM_SIZE clamp, B4 with its FABRIC attempt,
C through the legacy entry and through confidential compute, mnnvl on B1/B4/C) and one call
per pass-through. A change of wording fails here on purpose: update the table with it.
"""

from __future__ import annotations

import dataclasses

import pytest

from flashinfer_safe_workspace.planning.plan import Facts, PassThrough, Request, Unplanned
from flashinfer_safe_workspace.planning.rules import plan_for

R = dataclasses.replace
F = Facts(device_count=8)
EX = Facts(granularity=1, multicast_granularity=1, device_count=8, torch_signal_pad=9216)
NOIMEX = Facts(fabric_supported=True, fabric_nvml_ok=True, device_count=8, torch_signal_pad=9216)


def U(backend, ws=2, rank=0, t=127, h=4097, dt="bfloat16", **kw) -> Request:
    return Request("unified", backend, ws, rank, t, h, dt, has_comm_backend=True, **kw)


def L(ws=2, rank=0, t=127, h=4097, **kw) -> Request:
    return Request("legacy", "trtllm", ws, rank, t, h, None,
                   **{"create_metadata": True, "has_comm_backend": True, **kw})


DESCRIBE = [  # (version, call, facts) -> the plan's world size, dtype and description
    ("0.6.9", L(), EX, 2, None,
     'FlashInfer 0.6.9 (R2), legacy entry, backend trtllm, allocator A, handle -, device current\n'
     '  trtllm.buffer                 2.000 MiB  cudaMalloc  RU(ws*T*H*2, 2MiB)\n'
     '  trtllm.flag                   2.000 MiB  cudaMalloc  RU(ws*256*4, 2MiB)\n'
     '  trtllm.lamport                6.000 MiB  cudaMalloc  RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 2MiB)\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                    10.000 MiB'),
    ("0.6.6", U("trtllm"), NOIMEX, 2, 'bfloat16',
     'FlashInfer 0.6.6 (R1), unified entry, backend trtllm, allocator B1, handle fabric, device 0\n'
     '  trtllm.buffer               512.000 MiB  cuMemCreate RU(RU(RU(ws*T*H*2, 2MiB) + 2048, G=2097152), Gmc=536870912)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                 512.000 MiB  cuMemCreate RU(RU(RU(ws*256*4, 2MiB) + 2048, G=2097152), Gmc=536870912)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport              512.000 MiB  cuMemCreate RU(RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 2MiB) + 2048, G=2097152), Gmc=536870912)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                  1536.000 MiB\n'
     "  note: FABRIC handles without an IMEX channel: FlashInfer's export fails after the first cuMemCreate (RuntimeError on every rank)"),
    ("0.6.6", U("trtllm", 4, 3, 2048, 4097, "float32"), R(EX, device_count=2), 4, 'float32',
     'FlashInfer 0.6.6 (R1), unified entry, backend trtllm, allocator B1, handle posix, device 3\n'
     '  trtllm.buffer                66.002 MiB  cuMemCreate RU(RU(RU(ws*T*H*2, 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                   2.002 MiB  cuMemCreate RU(RU(RU(ws*256*4, 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport              386.002 MiB  cuMemCreate RU(RU(RU(3*min(ws*T*H*4, MAX_COMM_SIZE), 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                   454.006 MiB\n'
     '  note: allocates on cuda:3 (tp_rank) but this process sees 2 device(s): cuDeviceGet fails on this rank'),
    ("0.6.15", U("trtllm", 16, 1, 16384, 12288, "float32"), EX, 16, 'float32',
     'FlashInfer 0.6.15 (R5), unified entry, backend trtllm, allocator B2, handle posix, device current\n'
     '  trtllm.buffer              6144.002 MiB  cuMemCreate RU(RU(ws*T*H*2, 16) + 2048, G=1)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                   0.018 MiB  cuMemCreate RU(RU(ws*256*4, 16) + 2048, G=1)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport             6138.002 MiB  cuMemCreate RU(RU(3*min(ws*T*H*4, MAX_COMM_SIZE) clamped to MAX_COMM_SIZE, 16) + 2048, G=1)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                 12282.022 MiB'),
    ("0.7.4", U("trtllm"), NOIMEX, 2, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend trtllm, allocator B4, handle posix, device current\n'
     '  trtllm.buffer                 2.000 MiB  cuMemCreate RU(RU(ws*T*H*2, 16) + 2048, G=2097152) (FABRIC attempt, released)  (transient)\n'
     '  trtllm.buffer                 2.000 MiB  cuMemCreate RU(RU(ws*T*H*2, 16) + 2048, G=2097152)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                   2.000 MiB  cuMemCreate RU(RU(ws*256*4, 16) + 2048, G=2097152) (FABRIC attempt, released)  (transient)\n'
     '  trtllm.flag                   2.000 MiB  cuMemCreate RU(RU(ws*256*4, 16) + 2048, G=2097152)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport                6.000 MiB  cuMemCreate RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 16) + 2048, G=2097152) (FABRIC attempt, released)  (transient)\n'
     '  trtllm.lamport                6.000 MiB  cuMemCreate RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 16) + 2048, G=2097152)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                    10.000 MiB\n'
     '  note: FABRIC attempted first; no IMEX channel, so each buffer is created again with POSIX fds (same size)'),
    ("0.7.4", L(4, 3, 2048, 4097, use_fp32_lamport=True), EX, 4, None,
     'FlashInfer 0.7.4 (R10), legacy entry, backend trtllm, allocator C, handle posix, device current\n'
     '  trtllm.buffer               128.040 MiB  cuMemCreate RU(RU(RU(ws*T*H*4, 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.buffer.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.buffer.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.flag                   0.013 MiB  cuMemCreate RU(RU(RU(ws*256*4, 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.flag.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.flag.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.lamport              384.103 MiB  cuMemCreate RU(RU(RU(3*min(ws*T*H*4, MAX_COMM_SIZE), 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.lamport.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.lamport.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                   512.156 MiB'),
    ("0.7.4", U("mnnvl"), EX, 2, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend mnnvl, allocator B4, handle posix, device current\n'
     '  mnnvl.buffer                  6.003 MiB  cuMemCreate RU(RU(3*RU(max(t1*H*ws*e, 2*ceil(T/ws)*ws*H*e), 32) + 2048, G=1), Gmc=1)\n'
     '  mnnvl.signal_pads             0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.uc_ptrs                 0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.buffer_flags            0.000 MiB  torch       uint32[9]\n'
     '  peak held                     6.003 MiB'),
    ("0.6.10", U("mnnvl", 4, 3, 2048, 4097, "float32"), R(EX, multicast_supported=False), 4, 'float32',
     'FlashInfer 0.6.10 (R3), unified entry, backend mnnvl, allocator C, handle posix, device current\n'
     '  mnnvl.buffer                192.056 MiB  cuMemCreate RU(RU(floor(3*max(t1*H*ws*e, 2*ceil(T/ws)*ws*H*e)/4)*4, 16) + P_t=9216, G=1)\n'
     '  mnnvl.buffer.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  mnnvl.buffer.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  mnnvl.buffer_flags            0.000 MiB  torch       uint32[9]\n'
     '  peak held                   192.056 MiB\n'
     '  note: no multicast: torch leaves the multicast pointer 0 and FlashInfer still returns the workspace'),
    ("0.7.4", U("mnnvl", 8, 2, 1, 7168, "float16", force_oneshot_support=True), EX, 8, 'float16',
     'FlashInfer 0.7.4 (R10), unified entry, backend mnnvl, allocator B4, handle posix, device current\n'
     '  mnnvl.buffer                  0.330 MiB  cuMemCreate RU(RU(3*RU(T*H*ws*e, 32) + 2048, G=1), Gmc=1)\n'
     '  mnnvl.signal_pads             0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.uc_ptrs                 0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.buffer_flags            0.000 MiB  torch       uint32[9]\n'
     '  peak held                     0.330 MiB'),
    ("0.6.17", U("trtllm"), R(EX, confidential_compute=True), 2, 'bfloat16',
     'FlashInfer 0.6.17 (R6), unified entry, backend trtllm, allocator C, handle posix, device current\n'
     '  trtllm.buffer                 1.994 MiB  cuMemCreate RU(RU(RU(ws*T*H*2, 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.buffer.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.buffer.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.flag                   0.011 MiB  cuMemCreate RU(RU(RU(ws*256*4, 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.flag.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.flag.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.lamport                5.963 MiB  cuMemCreate RU(RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 16), 16) + P_t=9216, G=1)\n'
     '  trtllm.lamport.buffer_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  trtllm.lamport.signal_pad_ptrs        0.000 MiB  torch       raw_alloc(8*ws)\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                     7.968 MiB'),
    ("0.6.6", U("mnnvl", 4, 3, 2048, 4097, None), EX, 4, None,
     'FlashInfer 0.6.6 (R1), unified entry, backend mnnvl, allocator B1, handle posix, device 3\n'
     '  mnnvl.buffer                192.049 MiB  cuMemCreate RU(RU(3*max(t1*H*ws*e, 2*ceil(T/ws)*ws*H*e) + 2048, G=1), Gmc=1)\n'
     '  mnnvl.signal_pads             0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.uc_ptrs                 0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.buffer_flags            0.000 MiB  torch       uint32[9]\n'
     '  peak held                   192.049 MiB'),
    ("0.6.6", U("mnnvl", 4, 3, 2048, 4097, "bfloat16", gpus_per_node=2), EX, 4, 'bfloat16',
     'FlashInfer 0.6.6 (R1), unified entry, backend mnnvl, allocator B1, handle posix, device 1\n'
     '  mnnvl.buffer                 96.025 MiB  cuMemCreate RU(RU(3*max(t1*H*ws*e, 2*ceil(T/ws)*ws*H*e) + 2048, G=1), Gmc=1)\n'
     '  mnnvl.signal_pads             0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.uc_ptrs                 0.000 MiB  cuMemAlloc  8*ws\n'
     '  mnnvl.buffer_flags            0.000 MiB  torch       uint32[9]\n'
     '  peak held                    96.025 MiB'),
    ("0.6.6", U("trtllm", 4, 2, 1, 16), R(EX, device_count=2), 4, 'bfloat16',
     'FlashInfer 0.6.6 (R1), unified entry, backend trtllm, allocator B1, handle posix, device 2\n'
     '  trtllm.buffer                 2.002 MiB  cuMemCreate RU(RU(RU(ws*T*H*2, 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                   2.002 MiB  cuMemCreate RU(RU(RU(ws*256*4, 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport                2.002 MiB  cuMemCreate RU(RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 2MiB) + 2048, G=1), Gmc=1)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                     6.006 MiB\n'
     '  note: allocates on cuda:2 (tp_rank) but this process sees 2 device(s): cuDeviceGet fails on this rank'),
    ("0.7.4", U("trtllm", 2, 0, 1023, 524288), EX, 2, 'bfloat16',
     'FlashInfer 0.7.4 (R10), unified entry, backend trtllm, allocator B4, handle posix, device current\n'
     '  trtllm.buffer              2046.002 MiB  cuMemCreate RU(RU(ws*T*H*2, 16) + 2048, G=1)\n'
     '  trtllm.buffer.uc_ptrs         0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.flag                   0.004 MiB  cuMemCreate RU(RU(ws*256*4, 16) + 2048, G=1)\n'
     '  trtllm.flag.uc_ptrs           0.000 MiB  cuMemAlloc  8*ws\n'
     '  trtllm.lamport             6138.002 MiB  cuMemCreate RU(RU(3*min(ws*T*H*2, MAX_COMM_SIZE), 16) + 2048, G=1)\n'
     '  trtllm.lamport.uc_ptrs        0.000 MiB  cuMemAlloc  8*ws\n'
     '  control_flag                  0.000 MiB  cudaMalloc  5*int32\n'
     '  workspace_table               0.000 MiB  torch       int64[3*ws+1]\n'
     '  peak held                  8184.008 MiB'),
]

REASONS = [  # (version, call, facts) -> what the plan says: PassThrough or Unplanned
    ("0.5.3", L(use_symm_dev_mem=True), F,
     PassThrough('0.5.x has no use_symm_dev_mem/comm_backend parameter (FlashInfer TypeError)')),
    ("0.5.3", L(has_comm_backend=True), F,
     PassThrough('0.5.x has no use_symm_dev_mem/comm_backend parameter (FlashInfer TypeError)')),
    ("0.6.6", L(use_symm_dev_mem=True, create_metadata=False), F,
     PassThrough('use_symm_dev_mem needs create_metadata=True (FlashInfer ValueError)')),
    ("0.7.4", L(ws="2"), F,
     PassThrough("world_size='2' is not an int; FlashInfer decides")),
    ("0.7.4", L(t=0), F,
     PassThrough('max_token_num=0; FlashInfer decides')),
    ("0.7.4", L(h=True), F,
     PassThrough('hidden_dim=True is not an int; FlashInfer decides')),
    ("0.7.4", L(h=-3), F,
     PassThrough('hidden_dim=-3; FlashInfer decides')),
    ("0.5.3", U("trtllm"), F,
     PassThrough('this release has no create_allreduce_fusion_workspace')),
    ("0.7.1", U("trtllm", cutedsl_options=(("top_k", "8"),)), F,
     PassThrough('keyword-only mnnvl-cutedsl options do not exist in this release (FlashInfer TypeError)')),
    ("0.7.4", U("trtllm", cutedsl_options=(("top_k", "8"),)), F,
     PassThrough('mnnvl-cutedsl options given to another backend (FlashInfer ValueError)')),
    ("0.7.4", U("nccl"), F,
     PassThrough("unknown backend 'nccl'; FlashInfer raises RuntimeError")),
    ("0.7.4", U("trtllm", ws=2.0), F,
     PassThrough('world_size=2.0 is not an int; FlashInfer decides')),
    ("0.7.4", U("mnnvl", t=0), F,
     PassThrough('max_token_num=0; FlashInfer decides')),
    ("0.7.4", U("mnnvl-cutedsl", ws="8"), F,
     PassThrough("world_size='8' is not an int; FlashInfer decides")),
    ("0.7.4", U("mnnvl-cutedsl", ws=8, t=0), F,
     PassThrough('max_token_num=0; FlashInfer decides')),
    ("0.7.4", U("mnnvl-cutedsl", ws=8, h=0), F,
     PassThrough('hidden_dim=0; FlashInfer decides')),
    ("0.7.4", U("auto", ws=32), R(F, multicast_supported=False, multicast_all_ranks=False),
     PassThrough('no suitable backend (FlashInfer ValueError)')),
    ("0.7.4", U("mnnvl"), R(F, confidential_compute=True),
     PassThrough('mnnvl under confidential compute (FlashInfer ValueError)')),
    ("0.6.6", U("trtllm", rank=-1), F,
     PassThrough('tp_rank=-1 is the CUDA ordinal here; FlashInfer decides')),
    ("0.6.6", U("trtllm", rank="0"), F,
     PassThrough("tp_rank='0' is the CUDA ordinal here; FlashInfer decides")),
    ("0.6.6", U("trtllm"), R(F, multicast_supported=False),
     PassThrough('SymmDeviceMemory (0.6.0–0.6.14) needs a multicast-capable device; FlashInfer raises RuntimeError')),
    ("0.7.4", U("mnnvl"), R(F, multicast_supported=False),
     PassThrough('mnnvl needs NVLink multicast; FlashInfer raises RuntimeError before allocating')),
    ("0.7.4", U("mnnvl", ws=16, t=16384, h=12288, dt="float32", force_oneshot_support=True), F,
     PassThrough('mnnvl buffer larger than UINT32_MAX; FlashInfer raises ValueError')),
    ("0.6.6", U("mnnvl", gpus_per_node=0), F,
     PassThrough('gpus_per_node=0; FlashInfer decides')),
    ("0.6.6", U("mnnvl", gpus_per_node="8"), F,
     PassThrough("gpus_per_node='8'; FlashInfer decides")),
    ("0.6.6", U("mnnvl", rank="1"), F,
     PassThrough("rank='1'; FlashInfer decides")),
    ("0.7.4", U("mnnvl", dt="complex32"), F,
     Unplanned('no element size known for dtype complex32')),
    ("0.7.4", Request("other", "trtllm", 2, 0, 1, 1, None), F,
     Unplanned("unknown entry 'other'")),
    ("0.4.0", U("trtllm"), F,
     Unplanned('FlashInfer 0.4.0 is older than 0.5.0; no rules')),
]


@pytest.mark.parametrize("version,req,facts,world_size,dtype,text", DESCRIBE)
def test_the_plan_describes_itself(version, req, facts, world_size, dtype, text):
    plan = plan_for(req, facts, version)
    assert (plan.world_size, plan.dtype) == (world_size, dtype)
    assert plan.describe() == text


@pytest.mark.parametrize("version,req,facts,expected", REASONS)
def test_the_reason_of_each_pass_through(version, req, facts, expected):
    if isinstance(expected, Unplanned):
        with pytest.raises(Unplanned) as err:
            plan_for(req, facts, version)
        assert str(err.value) == str(expected)
    else:
        assert plan_for(req, facts, version) == expected


def test_an_mnnvl_buffer_of_exactly_uint32_max_is_planned():
    """FlashInfer raises ValueError for an mnnvl buffer *larger* than UINT32_MAX
    (``buffer_size_in_bytes > (2**32 - 1)``, trtllm_mnnvl_ar.py of 0.6.x, read at the
    release's source): one of exactly 2**32 - 1 bytes is created. Reachable with 1-byte
    elements, before 0.6.18's 32-byte rounding."""
    h = (2**32 - 1) // 3
    exact = U("mnnvl", 3, 0, 1, h, "int8", force_oneshot_support=True)
    plan = plan_for(exact, EX, "0.6.17")
    assert plan.allocations[0].bytes == 3 * (2**32 - 1) + 2048
    assert plan_for(R(exact, hidden_dim=h + 1), EX, "0.6.17") == PassThrough(
        "mnnvl buffer larger than UINT32_MAX; FlashInfer raises ValueError")
