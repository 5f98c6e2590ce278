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


def _package_dir():
    import flashinfer_safe_workspace

    from pathlib import Path

    return Path(flashinfer_safe_workspace.__file__).parent


def _imports(path) -> set:
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return out


def test_plan_types_import_nothing_from_the_rules():
    imports = _imports(_package_dir() / "planning" / "plan.py")
    assert not any("rules" in name or "facts" in name for name in imports), imports


def test_only_the_cutedsl_rules_import_torch_or_flashinfer():
    heavy = {}
    for path in sorted((_package_dir() / "planning" / "rules").glob("*.py")):
        found = {n for n in _imports(path) if n.split(".")[0] in ("torch", "flashinfer")}
        if found:
            heavy[path.name] = found
    assert heavy == {"cutedsl.py": {"flashinfer", "torch", "flashinfer.comm.mnnvl_cutedsl"}}


def test_importing_the_rules_loads_neither_torch_nor_flashinfer():
    import subprocess
    import sys

    code = ("import sys, flashinfer_safe_workspace.planning.rules as r, flashinfer_safe_workspace.planning.facts;"
            "print([m for m in ('torch', 'flashinfer') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
