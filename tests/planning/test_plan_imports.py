"""The planning layer's imports: the plan types import no rules, only the cutedsl rules
import torch or FlashInfer, and importing the rules loads neither (read from the source,
and in a fresh interpreter). Structure, not decisions: kept out of the fast layer
(``tests/unit``), whose mutated copies (scripts/mutation) import mutmut's trampolines."""


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
