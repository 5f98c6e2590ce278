"""Unit tests of the per-release allocation rules (the ``rules`` package).

The numbers are the worked examples E1–E3 of §5 of the reference
(/work/shared/reference/flashinfer-allocations.md), checked for every range R0–R10,
plus the PassThrough cases (arguments FlashInfer rejects before allocating), the
version -> range table and unknown versions.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashinfer_safe_workspace.planning import rules as R
from flashinfer_safe_workspace.planning.plan import (
    MiB,
    Facts,
    PassThrough,
    Plan,
    Request,
    Unplanned,
    round_up,
)
from flashinfer_safe_workspace.planning.rules import plan_for as make_plan

# One representative release per range (the conformance matrix uses the same ones).
RELEASE = {
    "R0": "0.5.3", "R1": "0.6.6", "R2": "0.6.9", "R3": "0.6.10", "R4": "0.6.14",
    "R5": "0.6.15", "R6": "0.6.17", "R7": "0.7.1", "R8": "0.7.2", "R9": "0.7.2.post1",
    "R10": "0.7.4",
}
ALL_RANGES = list(RELEASE)
UNIFIED_RANGES = ALL_RANGES[1:]

# E1: ws=2, T=2048, H=4096, bf16; E2: ws=8, T=2048, H=12288, bf16; E3: ws=4, T=16384, H=7168, fp32
EXAMPLES = {
    "E1": dict(world_size=2, max_token_num=2048, hidden_dim=4096, dtype="bfloat16"),
    "E2": dict(world_size=8, max_token_num=2048, hidden_dim=12288, dtype="bfloat16"),
    "E3": dict(world_size=4, max_token_num=16384, hidden_dim=7168, dtype="float32"),
}

G2 = Facts(granularity=2 * MiB, multicast_granularity=2 * MiB)
G512 = Facts(granularity=2 * MiB, multicast_granularity=512 * MiB)  # H200 (§9)


def unified(example: str, backend: str = "trtllm", **kw) -> Request:
    return Request("unified", backend, **{"rank": 0, **EXAMPLES[example], **kw})


def legacy(example: str, symm: bool = False, **kw) -> Request:
    args = dict(EXAMPLES[example])
    fp32 = args.pop("dtype") == "float32"
    return Request("legacy", "trtllm", use_fp32_lamport=fp32, use_symm_dev_mem=symm,
                   create_metadata=True, **{"rank": 0, **args, **kw})


def created(plan: Plan) -> list:
    """Held device-memory sizes of the big buffers (cuMemCreate / cudaMalloc), in MiB."""
    return [a.bytes / MiB for a in plan.allocations
            if a.held and a.api in ("cuMemCreate", "cudaMalloc") and a.bytes >= MiB]


def small(plan: Plan) -> list:
    return [(a.api, a.bytes) for a in plan.allocations if a.bytes < MiB]


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize("version,label", [
    ("0.5.0", "R0"), ("0.5.1", "R0"), ("0.5.3", "R0"),
    ("0.6.0", "R1"), ("0.6.6", "R1"),
    ("0.6.7", "R2"), ("0.6.7.post3", "R2"), ("0.6.8.post1", "R2"), ("0.6.9", "R2"),
    ("0.6.10", "R3"), ("0.6.10.post1", "R4"), ("0.6.11.post3", "R4"), ("0.6.14", "R4"),
    ("0.6.15", "R5"), ("0.6.15.post1", "R5"),
    ("0.6.16", "R6"), ("0.6.16.post4", "R6"), ("0.6.17", "R6"),
    ("0.6.18", "R7"), ("0.6.18.post1", "R7"), ("0.7.0", "R7"), ("0.7.0.post1", "R7"),
    ("0.7.1", "R7"), ("0.7.2", "R8"), ("0.7.2.post1", "R9"), ("0.7.4", "R10"),
    ("v0.7.4", "R10"), ("0.7.4+cu129", "R10"), ("0.6.10rc1", "R3"), ("0.7.2post1", "R9"),
])
def test_range_of(version, label):
    assert R.range_of(version) == label


@pytest.mark.parametrize("version", ["0.7.5", "0.7.10", "0.8.0", "1.0.0", "0.7.5rc1"])
def test_unknown_newer_versions_use_newest_rules(version):
    assert R.is_unknown(version)
    assert R.range_of(version) == "R10"
    plan = make_plan(unified("E1"), G2, version)
    assert plan.rules == "R10" and plan.allocator == "B4"
    assert plan.flashinfer_version == version


# The releases whose source was read, copied by hand from section 0 of the reference notes
# (wheels downloaded and read, an installed 0.7.4, and the "tag-verified" releases), not
# from the rules' own table.
READ_IN_THE_NOTES = """
    0.5.0 0.5.3 0.6.0 0.6.6 0.6.7 0.6.9 0.6.10 0.6.10.post1 0.6.14 0.6.15 0.6.16 0.6.16.post4
    0.6.17 0.6.18 0.6.18.post1 0.7.0 0.7.0.post1 0.7.1 0.7.2 0.7.2.post1 0.7.4
    0.5.1 0.5.2 0.6.1 0.6.2 0.6.3 0.6.4 0.6.5 0.6.7.post1 0.6.7.post2 0.6.7.post3 0.6.8
    0.6.8.post1 0.6.11 0.6.11.post1 0.6.11.post2 0.6.11.post3 0.6.12 0.6.13 0.6.15.post1
    0.6.16.post1 0.6.16.post2 0.6.16.post3
""".split()


@pytest.mark.parametrize("version", READ_IN_THE_NOTES + [
    "v0.7.2post1", "0.7.2-post1", "0.7.2-1", "0.7.2_post1", "0.7.4.0", " 0.6.11.post2 "])
def test_releases_read_are_verified(version):
    assert not R.is_unknown(version)


def test_the_read_table_is_the_notes_list():
    assert R.READ == frozenset(READ_IN_THE_NOTES)


# Issue 23, C2: these were "verified" because only major.minor.micro was compared.
UNREAD = ["0.7.4.post1", "0.7.4rc1", "0.7.3", "0.7.2.post2", "0.6.19", "0.6.10rc1",
          "0.7.4.dev0", "0.7.4+cu129", "0.6.11.post4", "0.7.2.post1.dev1", "0.7.0.post0"]


@pytest.mark.parametrize("version", UNREAD)
def test_releases_not_read_are_unknown_and_still_planned(version):
    assert R.is_unknown(version)
    plan = make_plan(unified("E1"), G2, version)  # with the rules of the range it falls in
    assert plan.rules == R.range_of(version) and plan.flashinfer_version == version
    assert R.unverified_why(version)


def test_a_post_release_is_planned_with_its_own_range():
    """0.7.2-post1 is 0.7.2.post1 (R9, the mnnvl-cutedsl factory), not 0.7.2 (R8)."""
    assert R.range_of("0.7.2-post1") == R.range_of("0.7.2-1") == "R9"
    assert R.range_of("0.7.2") == "R8"


def test_the_runtime_check_is_the_same_function():
    from flashinfer_safe_workspace.planning import request as _request

    for version in UNREAD:
        assert _request.unknown_version(version), version
    for version in READ_IN_THE_NOTES:
        assert not _request.unknown_version(version), version


@pytest.mark.parametrize("version,outcome", [("0.7.4.post1", "none"), ("0.7.4rc1", "none"),
                                             ("0.7.4", "created")])
def test_unknown_version_veto_covers_every_release_not_read(version, outcome):
    """Real gloo ranks, the real decision: with UNKNOWN_VERSION=veto an installed FlashInfer
    that reports a release not read is vetoed on every rank with UNKNOWN_VERSION (before the
    fix 0.7.4.post1 and 0.7.4rc1 counted as 0.7.4 and were created); 0.7.4 itself is not."""
    from harness import results, run_ranks

    runs = run_ranks(2, f"""
        import flashinfer, rank_lib
        flashinfer.__version__ = {version!r}  # what the installed release would report
        rank_lib.setup(free_mb=None, unknown_version="veto")
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(outcome=outcome, reasons=rank_lib.last_reasons, calls=len(rank_lib.calls),
                      warnings=rank_lib.warnings())
    """)
    rs = results(runs)
    for r in rs:
        assert r["outcome"] == outcome, r
        if outcome == "none":
            assert r["calls"] == 0 and "UNKNOWN_VERSION" in r["reasons"], r
            assert any(version in w and "UNKNOWN_VERSION" in w for w in r["warnings"]), r
        else:
            assert r["calls"] == 1 and r["reasons"] == [], r
    # the rank that ran its checks (a peer may follow its veto without them) says why
    said = [w for r in rs for w in r["warnings"] if "not read" in w or "development" in w]
    assert (outcome == "none") == any(version in w for w in said), rs


@pytest.mark.parametrize("version", ["0.4.1", "0.2.14.post1", "garbage", ""])
def test_versions_without_rules_are_unplanned(version):
    with pytest.raises(Unplanned):
        make_plan(unified("E1"), G2, version)


def test_parse_version():
    assert R.parse_version("0.7.2.post1") == (0, 7, 2, 1)
    assert R.parse_version("0.6") == (0, 6, 0, 0)


# --------------------------------------------------------------------------- trtllm, E1–E3

# Expected held cuMemCreate/cudaMalloc sizes (MiB) of buffers B, F, L (§5 trtllm table).
A_SIZES = {"E1": [32, 2, 96], "E2": [384, 2, 1152], "E3": [896, 2, 5376]}
B1_SIZES_GMC2 = {"E1": [34, 4, 98], "E2": [386, 4, 1154], "E3": [898, 4, 5378]}
B1_SIZES_GMC512 = {"E1": [512, 512, 512], "E2": [512, 512, 1536], "E3": [1024, 512, 5632]}
C_SIZES = {"E1": [34, 2, 98], "E2": [386, 2, 1154], "E3": [898, 2, 5378]}
C_SIZES_WIDE = {**C_SIZES, "E3": [1794, 2, 5378]}  # 0.7.2+: B = ws*T*H*4 for fp32


# The allocators, copied by hand from the reference's version-range table (section 1:
# "trtllm workspace via unified" and "Legacy fusion default" columns), not from the rules.
UNIFIED_TRTLLM_ALLOCATOR = {"R1": "B1", "R2": "B1", "R3": "C", "R4": "C", "R5": "B2",
                            "R6": "B3", "R7": "B3", "R8": "B3", "R9": "B3", "R10": "B4"}
LEGACY_DEFAULT_ALLOCATOR = {"R0": "A", "R1": "A", "R2": "A", "R3": "C", "R4": "C", "R5": "C",
                            "R6": "C", "R7": "C", "R8": "C", "R9": "C", "R10": "C"}
CC_FALLS_BACK_TO_C = {"R6", "R7", "R8", "R9", "R10"}  # "B3, or C if Confidential Computing"
WIDE_FP32_B = {"R8", "R9", "R10"}  # "B = ws*T*H*(4 if fp32 else 2)" from 0.7.2


def expected_trtllm(label: str, entry: str, symm: bool, facts: Facts, cc: bool = False):
    wide = C_SIZES_WIDE if label in WIDE_FP32_B else C_SIZES
    if entry == "legacy" and not symm:
        allocator = LEGACY_DEFAULT_ALLOCATOR[label]
        return allocator, (A_SIZES if allocator == "A" else wide)
    if entry == "unified" and cc and label in CC_FALLS_BACK_TO_C:
        return "C", wide
    allocator = UNIFIED_TRTLLM_ALLOCATOR[label]
    if allocator == "B1":
        return "B1", (B1_SIZES_GMC2 if facts.multicast_granularity == 2 * MiB else B1_SIZES_GMC512)
    return allocator, wide


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("label", UNIFIED_RANGES)
@pytest.mark.parametrize("facts", [G2, G512], ids=["Gmc2M", "Gmc512M"])
def test_trtllm_unified_examples(label, example, facts):
    plan = make_plan(unified(example), facts, RELEASE[label])
    allocator, sizes = expected_trtllm(label, "unified", True, facts)
    assert isinstance(plan, Plan)
    assert (plan.rules, plan.backend, plan.allocator) == (label, "trtllm", allocator)
    assert created(plan) == sizes[example]
    ws = EXAMPLES[example]["world_size"]
    tail = [("cudaMalloc", 20), ("torch", (3 * ws + 1) * 8)]
    if allocator.startswith("B"):
        assert small(plan) == [("cuMemAlloc", 8 * ws)] * 3 + tail
    else:
        assert small(plan) == [("torch", 8 * ws)] * 6 + tail
    assert plan.peak_bytes == sum(sizes[example]) * MiB + sum(b for _, b in small(plan))


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("label", ALL_RANGES)
def test_trtllm_legacy_default_examples(label, example):
    plan = make_plan(legacy(example), G512, RELEASE[label])
    allocator, sizes = expected_trtllm(label, "legacy", False, G512)
    assert (plan.entry, plan.allocator) == ("legacy", allocator)
    assert created(plan) == sizes[example]
    if allocator == "A":
        assert [a.api for a in plan.allocations] == ["cudaMalloc"] * 4 + ["torch"]
        assert plan.handle_type is None


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("label", UNIFIED_RANGES)
def test_trtllm_legacy_symm_examples(label, example):
    plan = make_plan(legacy(example, symm=True), G512, RELEASE[label])
    allocator, sizes = expected_trtllm(label, "unified", True, G512)
    assert plan.allocator == allocator  # R3–R4 ignore the flag: C either way
    assert created(plan) == sizes[example]


def test_exact_bytes_e1_e2():
    p = make_plan(unified("E1"), G2, "0.6.15")
    assert [a.bytes for a in p.allocations if a.api == "cuMemCreate"] == [
        35_651_584, 2_097_152, 102_760_448]
    p = make_plan(unified("E2"), G2, "0.6.12")
    assert sum(a.bytes for a in p.allocations if a.api == "cuMemCreate") == 1_616_904_192
    p = make_plan(legacy("E1"), G2, "0.5.0")
    assert sum(a.bytes for a in p.allocations if a.api == "cudaMalloc" and a.bytes > 20) \
        == 136_314_880
    p = make_plan(unified("E1"), G2, "0.6.0")
    assert sum(a.bytes for a in p.allocations if a.api == "cuMemCreate") == 142_606_336


@pytest.mark.parametrize("label", ["R6", "R7", "R8", "R9", "R10"])
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_confidential_compute_uses_torch_symm_mem(label, example):
    facts = dataclasses.replace(G2, confidential_compute=True)
    plan = make_plan(unified(example), facts, RELEASE[label])
    allocator, sizes = expected_trtllm(label, "unified", True, facts, cc=True)
    assert plan.allocator == "C" == allocator
    assert created(plan) == sizes[example]


@pytest.mark.parametrize("label", ["R1", "R2", "R3", "R4", "R5"])
def test_confidential_compute_ignored_before_0_6_16(label):
    on = make_plan(unified("E1"), dataclasses.replace(G2, confidential_compute=True),
                   RELEASE[label])
    off = make_plan(unified("E1"), G2, RELEASE[label])
    assert on == off
    mn = make_plan(unified("E1", "mnnvl"), dataclasses.replace(G2, confidential_compute=True),
                   RELEASE[label])
    assert isinstance(mn, Plan) and mn.backend == "mnnvl"


def test_max_comm_size_clamp():
    # ws=16, T=8192, H=12288, bf16: ws*T*H*2 = 3,221,225,472 > MAX_COMM_SIZE
    req = Request("unified", "trtllm", 16, 0, 8192, 12288, "bfloat16")
    plan = make_plan(req, Facts(granularity=1, multicast_granularity=1), "0.7.4")
    lamport = [a for a in plan.allocations if a.name == "trtllm.lamport"][0]
    assert R.MAX_COMM_SIZE == 2_145_386_496
    assert lamport.bytes == 3 * R.MAX_COMM_SIZE + 2048
    assert "clamped" in lamport.formula
    buffer = [a for a in plan.allocations if a.name == "trtllm.buffer"][0]
    assert buffer.bytes == 16 * 8192 * 12288 * 2 + 2048  # B is not clamped


def test_fp32_buffer_doubles_from_0_7_2_only():
    req = Request("unified", "trtllm", 2, 0, 3, 5, "float32")
    facts = Facts(granularity=1, multicast_granularity=1)
    b = {v: make_plan(req, facts, v).allocations[0].bytes for v in ("0.7.1", "0.7.2", "0.7.4")}
    assert b == {"0.7.1": 64 + 2048, "0.7.2": 128 + 2048, "0.7.4": 128 + 2048}
    # legacy: use_fp32_lamport, not the dtype, decides
    leg = Request("legacy", "trtllm", 2, 0, 3, 5, use_fp32_lamport=True)
    assert make_plan(leg, facts, "0.7.2").allocations[0].bytes == 128 + 2048


def test_pre_rounding_per_allocator_with_unit_granularity():
    facts = Facts(granularity=1, multicast_granularity=1, torch_signal_pad=2048)
    req = Request("unified", "trtllm", 2, 0, 3, 5, "bfloat16")  # B = 60 bytes
    assert make_plan(req, facts, "0.6.6").allocations[0].bytes == 2 * MiB + 2048  # B1
    assert make_plan(req, facts, "0.6.12").allocations[0].bytes == 64 + 2048  # C
    assert make_plan(req, facts, "0.6.15").allocations[0].bytes == 64 + 2048  # B2
    leg = Request("legacy", "trtllm", 2, 0, 3, 5)
    assert make_plan(leg, facts, "0.6.9").allocations[0].bytes == 2 * MiB  # A


# --------------------------------------------------------------------------- handle types


def test_b4_fabric_without_imex_retries_with_posix():
    facts = dataclasses.replace(G2, fabric_supported=True)
    plan = make_plan(unified("E1"), facts, "0.7.4")
    creates = [(a.bytes // MiB, a.handle_type, a.held) for a in plan.allocations
               if a.api == "cuMemCreate"]
    assert creates == [(34, "fabric", False), (34, "posix", True), (2, "fabric", False),
                       (2, "posix", True), (98, "fabric", False), (98, "posix", True)]
    assert plan.peak_bytes // MiB == 134 and plan.handle_type == "posix"
    assert len(plan.probe_allocations) == len(plan.allocations) - 3


def test_b4_fabric_with_imex_is_held():
    facts = dataclasses.replace(G2, fabric_supported=True, imex_channel=True)
    plan = make_plan(unified("E1"), facts, "0.7.4")
    creates = [(a.handle_type, a.held) for a in plan.allocations if a.api == "cuMemCreate"]
    assert creates == [("fabric", True)] * 3 and plan.handle_type == "fabric"


@pytest.mark.parametrize("label", ["R1", "R2", "R5", "R6", "R9"])
def test_b1_to_b3_need_nvml_fabric_state(label):
    only_attr = dataclasses.replace(G2, fabric_supported=True, imex_channel=True)
    assert make_plan(unified("E1"), only_attr, RELEASE[label]).handle_type == "posix"
    both = dataclasses.replace(only_attr, fabric_nvml_ok=True)
    plan = make_plan(unified("E1"), both, RELEASE[label])
    assert plan.handle_type == "fabric"
    assert all(a.held for a in plan.allocations)
    # without an IMEX channel FlashInfer fails at the export: planned, with a note
    no_imex = dataclasses.replace(both, imex_channel=False)
    plan = make_plan(unified("E1"), no_imex, RELEASE[label])
    assert any("IMEX" in n for n in plan.notes)


def test_b4_ignores_nvml_fabric_state():
    facts = dataclasses.replace(G2, fabric_supported=True, fabric_nvml_ok=False, imex_channel=True)
    assert make_plan(unified("E1"), facts, "0.7.4").handle_type == "fabric"


# --------------------------------------------------------------------------- mnnvl, E1–E3

MNNVL_GMC2 = {"E1": 98, "E2": 290, "E3": 2690}
MNNVL_GMC512 = {"E1": 512, "E2": 512, "E3": 3072}
MNNVL_ONESHOT = {"E1": 98, "E2": 1154, "E3": 5378}


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("label", UNIFIED_RANGES)
@pytest.mark.parametrize("facts", [G2, G512], ids=["Gmc2M", "Gmc512M"])
def test_mnnvl_examples(label, example, facts):
    plan = make_plan(unified(example, "mnnvl"), facts, RELEASE[label])
    r = int(label[1:])
    ws = EXAMPLES[example]["world_size"]
    assert plan.backend == "mnnvl"
    if r in (3, 4):
        assert plan.allocator == "C"
        assert created(plan) == [MNNVL_GMC2[example]]  # C applies no Gmc
        assert small(plan) == [("torch", 8 * ws), ("torch", 8 * ws), ("torch", 36)]
    else:
        assert plan.allocator == {1: "B1", 2: "B1", 5: "B2", 10: "B4"}.get(r, "B3")
        table = MNNVL_GMC2 if facts.multicast_granularity == 2 * MiB else MNNVL_GMC512
        assert created(plan) == [table[example]]
        assert small(plan) == [("cuMemAlloc", 8 * ws)] * 2 + [("torch", 36)]


@pytest.mark.parametrize("example", list(EXAMPLES))
@pytest.mark.parametrize("label", UNIFIED_RANGES)
def test_mnnvl_force_oneshot(label, example):
    plan = make_plan(unified(example, "mnnvl", force_oneshot_support=True), G2, RELEASE[label])
    assert created(plan) == [MNNVL_ONESHOT[example]]


def test_mnnvl_exact_requests():
    exact = Facts(granularity=1, multicast_granularity=1)
    plan = make_plan(unified("E2", "mnnvl"), exact, "0.6.17")
    assert plan.allocations[0].bytes == 301_989_888 + 2048
    # 0.6.18+: each Lamport buffer is rounded up to 32 bytes first
    req = Request("unified", "mnnvl", 2, 0, 1, 4, "bfloat16", force_oneshot_support=True)
    assert make_plan(req, exact, "0.6.17").allocations[0].bytes == 3 * 16 + 2048
    assert make_plan(req, exact, "0.7.1").allocations[0].bytes == 3 * 32 + 2048
    # C (0.6.10–0.6.14): one float32 tensor, bytes floored to a multiple of 4, then RU 16
    odd = Request("unified", "mnnvl", 2, 0, 1, 3, "bfloat16", force_oneshot_support=True)
    # buf = 12, 3*buf = 36 -> 36 -> RU16 = 48 -> + P_t
    assert make_plan(odd, exact, "0.6.12").allocations[0].bytes == 48 + 2048
    odd2 = Request("unified", "mnnvl", 2, 0, 1, 1, "int8", force_oneshot_support=True)
    # buf = 2, 3*buf = 6 -> floor to 4 -> RU16 = 16
    assert make_plan(odd2, exact, "0.6.12").allocations[0].bytes == 16 + 2048


def test_mnnvl_default_dtype_is_float32():
    plan = make_plan(unified("E1", "mnnvl", dtype=None), G2, "0.7.4")
    ref = make_plan(unified("E1", "mnnvl", dtype="float32"), G2, "0.7.4")
    assert plan.allocations == ref.allocations


def test_mnnvl_too_large_is_passthrough():
    req = Request("unified", "mnnvl", 8, 0, 32768, 16384, "float32", force_oneshot_support=True)
    assert isinstance(make_plan(req, G2, "0.7.4"), PassThrough)


def test_mnnvl_without_multicast():
    facts = dataclasses.replace(G2, multicast_supported=False)
    for label in ("R1", "R2", "R5", "R6", "R10"):
        assert isinstance(make_plan(unified("E1", "mnnvl"), facts, RELEASE[label]), PassThrough)
    plan = make_plan(unified("E1", "mnnvl"), facts, "0.6.12")  # C: no check
    assert isinstance(plan, Plan) and plan.notes


# --------------------------------------------------------------------------- devices


def test_device_per_release():
    f = dataclasses.replace(G2, device_count=8)
    assert make_plan(unified("E2", rank=5), f, "0.6.6").device == 5
    assert make_plan(legacy("E2", symm=True, rank=5), f, "0.6.6").device == 5
    assert make_plan(legacy("E2", rank=5), f, "0.6.6").device is None  # A: current device
    assert make_plan(unified("E2", "mnnvl", rank=5), f, "0.6.6").device == 5
    assert make_plan(unified("E2", "mnnvl", rank=5, gpus_per_node=4), f, "0.6.6").device == 1
    assert make_plan(unified("E2", "mnnvl", rank=5), dataclasses.replace(f, device_count=2),
                     "0.6.6").device == 1
    for v in ("0.6.9", "0.6.12", "0.6.15", "0.7.4"):
        assert make_plan(unified("E2", rank=5), f, v).device is None
        assert make_plan(unified("E2", "mnnvl", rank=5), f, v).device is None


def test_r1_device_beyond_visible_devices_is_noted():
    plan = make_plan(unified("E2", rank=3), dataclasses.replace(G2, device_count=1), "0.6.6")
    assert plan.device == 3 and any("cuDeviceGet" in n for n in plan.notes)


# --------------------------------------------------------------------------- auto


@pytest.mark.parametrize("label", ["R1", "R3", "R4", "R5"])
def test_auto_is_mnnvl_before_0_6_16(label):
    for mc in (True, False, None):
        facts = dataclasses.replace(G2, multicast_all_ranks=mc)
        plan = make_plan(unified("E1", "auto"), facts, RELEASE[label])
        assert plan.backend == "mnnvl"
    assert not R.needs_group_multicast_vote(unified("E1", "auto"), RELEASE[label])


@pytest.mark.parametrize("label", ["R6", "R7", "R8", "R9", "R10"])
def test_auto_votes_from_0_6_16(label):
    v = RELEASE[label]
    assert R.needs_group_multicast_vote(unified("E1", "auto"), v)
    assert not R.needs_group_multicast_vote(unified("E1", "trtllm"), v)
    assert not R.needs_group_multicast_vote(legacy("E1"), v)
    yes = dataclasses.replace(G2, multicast_all_ranks=True)
    no = dataclasses.replace(G2, multicast_all_ranks=False)
    assert make_plan(unified("E1", "auto"), yes, v).backend == "mnnvl"
    assert make_plan(unified("E1", "auto"), no, v).backend == "trtllm"
    # not every rank: trtllm even though this rank supports multicast
    assert make_plan(unified("E1", "auto"), no, v).allocator in ("B3", "B4")
    big = Request("unified", "auto", 32, 0, 16, 4096, "bfloat16")
    assert isinstance(make_plan(big, no, v), PassThrough)
    assert make_plan(big, yes, v).backend == "mnnvl"
    cc = dataclasses.replace(yes, confidential_compute=True)
    assert isinstance(make_plan(unified("E1", "auto"), cc, v), PassThrough)
    cc_no = dataclasses.replace(no, confidential_compute=True)
    assert make_plan(unified("E1", "auto"), cc_no, v).allocator == "C"


# --------------------------------------------------------------------------- pass-through


@pytest.mark.parametrize("req,version", [
    (Request("legacy", "trtllm", 2, 0, 16, 64, use_symm_dev_mem=True), "0.7.4"),
    (Request("legacy", "trtllm", 2, 0, 16, 64, use_symm_dev_mem=True,
             create_metadata=True), "0.5.3"),
    (Request("legacy", "trtllm", 2, 0, 16, 64, has_comm_backend=True), "0.5.3"),
    (Request("unified", "trtllm", 2, 0, 16, 64, "bfloat16"), "0.5.3"),
    (Request("unified", "nccl", 2, 0, 16, 64, "bfloat16"), "0.7.4"),
    (Request("unified", "mnnvl-cutedsl", 2, 0, 16, 64, "bfloat16"), "0.7.2"),
    (Request("unified", "trtllm", 2, 0, 16, 64, "bfloat16",
             cutedsl_options=(("top_k", "8"),)), "0.7.4"),
    (Request("unified", "trtllm", 2, 0, 16, 64, "bfloat16",
             cutedsl_options=(("top_k", "8"),)), "0.7.1"),
    (Request("unified", "mnnvl", 2, 0, 16, 64, "bfloat16"), "0.6.17"),  # with CC facts below
    (Request("unified", "trtllm", 2, 0, "16", 64, "bfloat16"), "0.7.4"),
    (Request("unified", "trtllm", 2, 0, 0, 64, "bfloat16"), "0.7.4"),
    (Request("unified", "trtllm", True, 0, 16, 64, "bfloat16"), "0.7.4"),
    (Request("unified", "trtllm", 2, 0, 16, None, "bfloat16"), "0.7.4"),
    (Request("legacy", "trtllm", 2, 0, 16, -1), "0.6.9"),
])
def test_passthrough(req, version):
    facts = dataclasses.replace(G2, confidential_compute=True)
    assert isinstance(make_plan(req, facts, version), PassThrough)


def test_b1_without_multicast_is_passthrough_even_for_trtllm():
    facts = dataclasses.replace(G2, multicast_supported=False)
    assert isinstance(make_plan(unified("E1"), facts, "0.6.6"), PassThrough)
    assert isinstance(make_plan(legacy("E1", symm=True), facts, "0.6.9"), PassThrough)
    assert make_plan(legacy("E1"), facts, "0.6.9").allocator == "A"
    assert make_plan(unified("E1"), facts, "0.6.15").allocator == "B2"  # B2: no check


# --------------------------------------------------------------------------- mnnvl-cutedsl

BLACKWELL = dataclasses.replace(G2, compute_capability=(10, 0))


def cutedsl(**kw) -> Request:
    args = dict(entry="unified", backend="mnnvl-cutedsl", world_size=8, rank=0,
                max_token_num=2048, hidden_dim=8192, dtype="bfloat16")
    args.update(kw)
    return Request(**args)


@pytest.mark.parametrize("req,facts", [
    (cutedsl(world_size=6), BLACKWELL),
    (cutedsl(dtype="float16"), BLACKWELL),
    (cutedsl(dtype="float32"), BLACKWELL),
    (cutedsl(gpus_per_node=8), BLACKWELL),
    (cutedsl(has_comm_backend=True), BLACKWELL),
    (cutedsl(force_oneshot_support=True), BLACKWELL),
    (cutedsl(rank=8), BLACKWELL),
    (cutedsl(cutedsl_options=(("apply_rms_norm", "False"),
                              ("write_residual_output", "False"))), BLACKWELL),
    (cutedsl(cutedsl_options=(("output_dtype", "torch.float16"),)), BLACKWELL),
    (cutedsl(cutedsl_options=(("dynamic_fp8", "True"),)), BLACKWELL),
    (cutedsl(cutedsl_options=(("write_norm_output", "True"),)), BLACKWELL),
    (cutedsl(cutedsl_options=(("apply_rms_norm", "False"),
                              ("output_dtype", "torch.float8_e4m3fn"))), BLACKWELL),
    (cutedsl(), G2),  # Hopper
    (cutedsl(), dataclasses.replace(BLACKWELL, multicast_supported=False)),
])
def test_cutedsl_rejections_are_passthrough(req, facts):
    assert isinstance(make_plan(req, facts, "0.7.4"), PassThrough)


@pytest.mark.parametrize("version", ["0.7.2.post1", "0.8.0"])
def test_cutedsl_supported_shape_is_unplanned_outside_0_7_4(version):
    """D is planned only for the release the conformance test checked (0.7.4)."""
    with pytest.raises(Unplanned, match="mnnvl-cutedsl"):
        make_plan(cutedsl(), BLACKWELL, version)
    with pytest.raises(Unplanned):
        make_plan(cutedsl(cutedsl_options=(("top_k", "10"),
                                           ("output_dtype", "torch.float8_e4m3fn"))),
                  BLACKWELL, version)


def _installed_flashinfer():
    flashinfer = pytest.importorskip("flashinfer")
    pytest.importorskip("flashinfer.comm.mnnvl_cutedsl")
    if R.parse_version(flashinfer.__version__)[:3] != (0, 7, 4):
        pytest.skip(f"D is planned for 0.7.4; {flashinfer.__version__} is installed")
    return flashinfer


def test_cutedsl_reference_example():
    """§5: tp=8, H=8192, top_k=10, T=2048 on cc (10,0): LL 23, BT 1024, HT 2048 tokens;
    symmetric blocks 10, 50, 50, 2, 2, 34, 34 MiB (182 MiB) for any P_t <= 2 MiB."""
    fi = _installed_flashinfer()
    for pad in (2048, 9216):
        facts = dataclasses.replace(BLACKWELL, torch_signal_pad=pad)
        plan = make_plan(cutedsl(cutedsl_options=(("top_k", "10"),)), facts, fi.__version__)
        assert isinstance(plan, Plan) and plan.allocator == "D" and plan.handle_type == "posix"
        blocks = [a for a in plan.allocations if a.api == "cuMemCreate"]
        assert [a.bytes // MiB for a in blocks] == [10, 50, 50, 2, 2, 34, 34]
        assert all(a.bytes % MiB == 0 for a in blocks)
        assert sum(a.bytes for a in blocks) == 182 * MiB
        names = [a.name for a in plan.allocations]
        assert names[:4] == ["cutedsl.ll.mailbox", "cutedsl.ll.mailbox.buffer_ptrs",
                             "cutedsl.ll.mailbox.signal_pad_ptrs", "cutedsl.ll.stage_state"]
        small = {a.name: a.bytes for a in plan.allocations if a.api == "torch"}
        assert small["cutedsl.ll.stage_state"] == 8
        assert small["cutedsl.bt.stage_state"] == 24
        assert small["cutedsl.bt.prenorm.peer_addresses"] == 64
        assert small["cutedsl.ht.routed_processed"] == 256 * 8 * 4
        assert "cutedsl.ll.mailbox.peer_addresses" not in small  # no peer-store preset
        assert plan.peak_bytes == sum(a.bytes for a in plan.allocations)
    # the logical sizes of §5, read back at granularity 1 and P_t = 0
    exact = dataclasses.replace(BLACKWELL, granularity=1, torch_signal_pad=0)
    plan = make_plan(cutedsl(), exact, fi.__version__)
    assert [a.bytes for a in plan.allocations if a.api == "cuMemCreate"] == [
        9043968, 50331648, 50331648, 1024, 1024, 33554432, 33554432]
    assert "LL=23 BT=1024 HT=2048" in plan.notes[0]


def test_cutedsl_small_token_count_is_ll_only():
    fi = _installed_flashinfer()
    plan = make_plan(cutedsl(max_token_num=15), BLACKWELL, fi.__version__)
    assert [a.name for a in plan.allocations if a.api == "cuMemCreate"] == [
        "cutedsl.ll.mailbox"]
    assert plan.allocations[0].bytes == 6 * MiB  # RU(3*8*15*8192*2 + P_t, 2 MiB)
    assert [a.name for a in plan.allocations] == [
        "cutedsl.ll.mailbox", "cutedsl.ll.mailbox.buffer_ptrs",
        "cutedsl.ll.mailbox.signal_pad_ptrs", "cutedsl.ll.stage_state"]


def test_cutedsl_no_norm_two_shot_and_placeholder():
    """NO_NORM_CONFIG tp4 H8192 on cc (10,3) routes 25–320 tokens to three LL two-shot
    shapes, each with its own scatter/gather pair; the gamma placeholder comes first."""
    fi = _installed_flashinfer()
    facts = dataclasses.replace(BLACKWELL, compute_capability=(10, 3))
    req = cutedsl(world_size=4, max_token_num=300,
                  cutedsl_options=(("apply_rms_norm", "False"),))
    plan = make_plan(req, facts, fi.__version__)
    assert plan.allocations[0].name == "cutedsl.gamma_placeholder"
    assert plan.allocations[0].bytes == 8192 * 2
    names = [a.name for a in plan.allocations if a.api == "cuMemCreate"]
    assert names.count("cutedsl.ll.two_shot.scatter") == 3
    assert names.count("cutedsl.ll.two_shot.gather") == 3
    assert "cutedsl.ll.mailbox.peer_addresses" in [a.name for a in plan.allocations]
    assert not any(n.startswith("cutedsl.ht") for n in names)


def test_cutedsl_rejections_from_the_profile_tables():
    fi = _installed_flashinfer()
    from flashinfer.comm import mnnvl_cutedsl as tables

    v = fi.__version__
    # no profile for this hidden size / top_k / architecture-specific shape
    assert isinstance(make_plan(cutedsl(hidden_dim=4096), BLACKWELL, v), PassThrough)
    assert isinstance(make_plan(cutedsl(cutedsl_options=(("top_k", "8"),)), BLACKWELL, v),
                      PassThrough)
    assert isinstance(make_plan(cutedsl(world_size=4), BLACKWELL, v), PassThrough)  # cc 10.0
    # a config measured with the norm, asked without it
    values = (("apply_rms_norm", False), ("config", tables.DEFAULT_CONFIG))
    req = cutedsl(cutedsl_options=tuple((n, repr(x)) for n, x in values), cutedsl_values=values)
    assert isinstance(make_plan(req, BLACKWELL, v), PassThrough)
    # HT without the norm (a protocol-pinned config suits either)
    values = (("apply_rms_norm", False), ("config", tables.HT_ONLY_CONFIG))
    req = cutedsl(cutedsl_options=tuple((n, repr(x)) for n, x in values), cutedsl_values=values)
    assert "HT" in make_plan(req, BLACKWELL, v).reason
    # the LL two-shot all-reduce has no dynamic FP8 output
    either = dataclasses.replace(tables.NO_NORM_CONFIG, applies_rms_norm=None)
    values = (("config", either), ("dynamic_fp8", True),
              ("output_dtype", __import__("torch").float8_e4m3fn))
    req = cutedsl(world_size=4, max_token_num=300, cutedsl_values=values,
                  cutedsl_options=tuple((n, repr(x)) for n, x in values))
    facts = dataclasses.replace(BLACKWELL, compute_capability=(10, 3))
    assert "two-shot" in make_plan(req, facts, v).reason


def test_cutedsl_custom_config_needs_its_value():
    fi = _installed_flashinfer()
    from flashinfer.comm import mnnvl_cutedsl as tables

    options = (("config", repr(tables.LL_ONLY_CONFIG)),)
    with pytest.raises(Unplanned, match="repr"):
        make_plan(cutedsl(cutedsl_options=options), BLACKWELL, fi.__version__)
    plan = make_plan(cutedsl(cutedsl_options=options,
                             cutedsl_values=(("config", tables.LL_ONLY_CONFIG),)),
                     BLACKWELL, fi.__version__)
    assert [a.name for a in plan.allocations if a.api == "cuMemCreate"] == [
        "cutedsl.ll.mailbox"]
    assert plan.allocations[0].bytes == round_up(3 * 8 * 2048 * 8192 * 2 + 2048, 2 * MiB)


def test_cutedsl_unplanned_without_flashinfer_tables(monkeypatch):
    fi = _installed_flashinfer()
    import sys

    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer.comm.mnnvl_cutedsl", None)
        with pytest.raises(Unplanned, match="cannot be imported"):
            make_plan(cutedsl(), BLACKWELL, fi.__version__)
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", None)
        with pytest.raises(Unplanned, match="cannot be imported"):
            make_plan(cutedsl(), BLACKWELL, fi.__version__)
    # the argument checks still answer without FlashInfer's tables
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", None)
        assert isinstance(make_plan(cutedsl(world_size=6), BLACKWELL, fi.__version__),
                          PassThrough)


def test_cutedsl_unplanned_when_installed_release_differs(monkeypatch):
    fi = _installed_flashinfer()
    monkeypatch.setattr(fi, "__version__", "0.7.4.post9")
    with pytest.raises(Unplanned, match="not 0.7.4"):
        make_plan(cutedsl(), BLACKWELL, "0.7.4")


def test_cutedsl_plan_ignores_rank_and_notes_a_peer_without_multicast():
    fi = _installed_flashinfer()
    a = make_plan(cutedsl(rank=0), BLACKWELL, fi.__version__)
    b = make_plan(cutedsl(rank=7), BLACKWELL, fi.__version__)
    assert a.digest() == b.digest()
    peer = dataclasses.replace(BLACKWELL, multicast_all_ranks=False)
    assert any("multicast" in n for n in make_plan(cutedsl(), peer, fi.__version__).notes)
# --------------------------------------------------------------------------- invariants (fuzz)

versions = st.sampled_from(list(RELEASE.values()) + ["0.6.0", "0.6.13", "0.6.18", "0.7.9"])
requests = st.builds(
    Request,
    entry=st.sampled_from(["unified", "legacy"]),
    backend=st.sampled_from(["trtllm", "mnnvl", "auto", "mnnvl-cutedsl"]),
    world_size=st.integers(1, 72),
    rank=st.one_of(st.integers(0, 71), st.none()),
    max_token_num=st.integers(1, 1 << 17),
    hidden_dim=st.integers(1, 1 << 15),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", None, "torch.float32", "int8"]),
    force_oneshot_support=st.booleans(),
    gpus_per_node=st.sampled_from([None, 1, 4, 8]),
    use_fp32_lamport=st.booleans(),
    use_symm_dev_mem=st.booleans(),
    create_metadata=st.booleans(),
    has_comm_backend=st.booleans(),
)
facts_st = st.builds(
    Facts,
    granularity=st.sampled_from([1, 4096, 2 * MiB]),
    multicast_granularity=st.sampled_from([2 * MiB, 512 * MiB]),
    fabric_supported=st.booleans(),
    fabric_nvml_ok=st.booleans(),
    multicast_supported=st.booleans(),
    multicast_all_ranks=st.sampled_from([None, True, False]),
    confidential_compute=st.booleans(),
    device_count=st.integers(1, 8),
    compute_capability=st.sampled_from([(9, 0), (10, 0)]),
    imex_channel=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(requests, facts_st, versions)
def test_plan_invariants(req, facts, version):
    try:
        plan = make_plan(req, facts, version)
    except Unplanned as exc:
        assert req.backend == "mnnvl-cutedsl", exc  # the only planned-out case
        return
    if isinstance(plan, PassThrough):
        assert plan.reason
        return
    assert plan.rules == R.range_of(version)
    assert plan.allocations and all(a.bytes > 0 for a in plan.allocations)
    assert plan.peak_bytes == sum(a.bytes for a in plan.allocations if a.held)
    for a in plan.allocations:
        if a.api == "cuMemCreate":
            assert a.bytes % facts.granularity == 0
            assert a.handle_type in ("posix", "fabric")
    transients = [a for a in plan.allocations if not a.held]
    if transients:  # only B4's FABRIC attempt, each followed by the same size with POSIX
        assert plan.allocator == "B4"
        for i, a in enumerate(plan.allocations):
            if not a.held:
                nxt = plan.allocations[i + 1]
                assert (nxt.bytes, nxt.handle_type, nxt.held) == (a.bytes, "posix", True)
    if plan.backend == "trtllm":
        assert plan.allocations[-2].api == "cudaMalloc" and plan.allocations[-2].bytes == 20
        assert plan.allocations[-1].bytes == (3 * req.world_size + 1) * 8
    elif plan.backend == "mnnvl-cutedsl":
        assert plan.allocator == "D" and plan.allocations[0].api in ("cuMemCreate", "torch")
    else:
        assert plan.allocations[-1].bytes == 36
    if isinstance(req.rank, int):
        rank_other = dataclasses.replace(req, rank=(req.rank + 1) % 72)
        other = make_plan(rank_other, facts, version)
        assert isinstance(other, Plan) and other.digest() == plan.digest()


def test_torch_prefixed_dtype_names():
    facts = Facts(granularity=1, multicast_granularity=1)
    for v in ("0.7.2", "0.7.4"):
        a = make_plan(Request("unified", "trtllm", 2, 0, 3, 5, "torch.float32"), facts, v)
        b = make_plan(Request("unified", "trtllm", 2, 0, 3, 5, "float32"), facts, v)
        assert a.allocations == b.allocations
    a = make_plan(Request("unified", "mnnvl", 2, 0, 3, 5, "torch.bfloat16"), facts, "0.7.4")
    b = make_plan(Request("unified", "mnnvl", 2, 0, 3, 5, "bfloat16"), facts, "0.7.4")
    assert a.allocations == b.allocations


def test_non_int_rank_where_it_is_the_device():
    assert isinstance(make_plan(unified("E1", rank=None), G2, "0.6.6"), PassThrough)
    assert isinstance(make_plan(unified("E1", "mnnvl", rank=None), G2, "0.6.6"), PassThrough)
    assert isinstance(make_plan(unified("E1", rank=None), G2, "0.7.4"), Plan)


@settings(max_examples=150, deadline=None)
@given(profile_index=st.integers(0, 9), tokens=st.integers(1, 1 << 15),
       granularity=st.sampled_from([1, 4096, 2 * MiB]), pad=st.sampled_from([0, 2048, 9216]),
       rank=st.integers(0, 15))
def test_cutedsl_plan_invariants(profile_index, tokens, granularity, pad, rank):
    fi = _installed_flashinfer()
    from flashinfer.comm import mnnvl_cutedsl as tables

    profiles = tables.DEFAULT_CONFIG.profiles
    profile = profiles[profile_index % len(profiles)]
    facts = dataclasses.replace(BLACKWELL, granularity=granularity, torch_signal_pad=pad,
                                compute_capability=profile.compute_capability or (10, 0))
    req = cutedsl(world_size=profile.tp_size, rank=rank % profile.tp_size,
                  max_token_num=tokens, hidden_dim=profile.hidden_size,
                  cutedsl_options=(("top_k", str(profile.top_k)),))
    plan = make_plan(req, facts, fi.__version__)
    assert isinstance(plan, Plan), plan  # the default routes are unbounded
    ws, h = profile.tp_size, profile.hidden_size
    blocks = [a for a in plan.allocations if a.api == "cuMemCreate"]
    assert blocks and all(a.bytes % granularity == 0 and a.held for a in blocks)
    assert all(a.handle_type == "posix" for a in blocks)
    # each block is followed by the rendezvous' two pointer arrays
    for i, a in enumerate(plan.allocations):
        if a.api == "cuMemCreate":
            assert [b.bytes for b in plan.allocations[i + 1:i + 3]] == [8 * ws, 8 * ws]
    # every buffer holds at most the max_token_num rows it may serve
    for a in blocks:
        if a.name in ("cutedsl.ht.local", "cutedsl.ht.prenorm"):
            assert a.bytes - pad <= round_up(tokens * h * 2, granularity) + granularity
    assert plan.peak_bytes == sum(a.bytes for a in plan.allocations)


@pytest.mark.parametrize("pad,blocks", [(9216, (10, 2, 26)), (2048, (8, 2, 24))])
def test_legacy_default_path_carries_torch_signal_pad(pad, blocks):
    """Issue 11's example: 0.7.4's legacy default path (allocator C), ws 8, T 91,
    H 2880, fp32. torch 2.11+ pads with 9216 bytes: 10 + 2 + 26 MiB, not 8 + 2 + 24."""
    req = Request("legacy", "trtllm", 8, 0, 91, 2880, "float32", use_fp32_lamport=True,
                  create_metadata=True)
    plan = make_plan(req, Facts(torch_signal_pad=pad), "0.7.4")
    assert plan.allocator == "C"
    assert [a.bytes for a in plan.allocations if a.api == "cuMemCreate"] == \
        [n * MiB for n in blocks]
