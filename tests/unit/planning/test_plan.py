"""Plan types: size-aware multicast granularity, digest, JSON shape."""

from flashinfer_safe_workspace.planning.plan import MiB, Facts, Request
from flashinfer_safe_workspace.planning.rules import plan_for as make_plan


def _rule(size):  # a made-up per-size rule whose switch (64 MiB) falls between the buffers
    return 2 * MiB if size < 64 * MiB else 512 * MiB


def test_b1_rounds_each_buffer_to_the_granularity_of_its_own_size():
    req = Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16")
    plan = make_plan(req, Facts(multicast_granularity_for=_rule), "0.6.6")
    sizes = [a.bytes for a in plan.allocations if a.api == "cuMemCreate"]
    # B 32 MiB -> 34 MiB (small: 2 MiB granularity) -> 34 MiB; F 2 KiB -> 2 MiB -> 4 MiB;
    # L 96 MiB -> 98 MiB (large: 512 MiB granularity) -> 512 MiB
    assert sizes == [34 * MiB, 4 * MiB, 512 * MiB]


def test_b1_with_the_measured_h200_rule():
    """The H200's answer (docs/gpu/mc-granularity-*.jsonl: 2 MiB for objects up to 2 MiB, 512 MiB
    from 4 MiB up): every trtllm buffer of this shape is over 2 MiB once padded, so B1 asks for
    3 x 512 MiB (reference section 9: "3 x 512 MiB = 1536 MiB")."""
    from flashinfer_safe_workspace.planning import facts as _facts

    req = Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16")
    plan = make_plan(req, Facts(multicast_granularity_for=_facts.h200_multicast_granularity), "0.6.6")
    assert [a.bytes for a in plan.allocations if a.api == "cuMemCreate"] == [512 * MiB] * 3


def test_a_fixed_granularity_applies_when_no_rule_is_given():
    req = Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16")
    plan = make_plan(req, Facts(multicast_granularity=512 * MiB), "0.6.6")
    assert [a.bytes for a in plan.allocations if a.api == "cuMemCreate"] == [512 * MiB] * 3


def test_digest_ignores_rank_but_not_shape():
    a = make_plan(Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16"), Facts(), "0.7.4")
    b = make_plan(Request("unified", "trtllm", 2, 1, 2048, 4096, "bfloat16"), Facts(), "0.7.4")
    c = make_plan(Request("unified", "trtllm", 2, 1, 4096, 4096, "bfloat16"), Facts(), "0.7.4")
    assert a.digest() == b.digest() != c.digest()
    assert 0 < a.digest() < 2**62


def test_json_has_the_documented_keys():
    plan = make_plan(Request("unified", "trtllm", 2, 0, 2048, 4096, "bfloat16"), Facts(), "0.7.4")
    doc = plan.to_json()
    for key in ("flashinfer_version", "backend", "allocator", "handle_type", "device",
                "allocations", "peak_bytes"):
        assert key in doc
    assert doc["peak_bytes"] == sum(a["bytes"] for a in doc["allocations"] if a["held"])
    assert all({"name", "bytes", "api"} <= set(a) for a in doc["allocations"])
