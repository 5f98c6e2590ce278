"""The README's commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    return [l.strip() for l in lines[:20] if l.startswith("    python3 -m venv")]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = _commands()[:2]
    assert "flashinfer_safe_workspace demo --world-size 2 --starve-rank 0" in demo
    assert "pytest" in tests
    assert "torch==2.13.0" in demo and "torch==2.13.0" in tests


def test_ci_runs_exactly_the_readme_test_command():
    tests = _commands()[1]
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
          if l.strip() and not l.startswith("#")]
    assert tests in ci


def test_readme_engine_rows_match_the_verified_table():
    import re
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "engines"))
    from _runner import doc_outcomes

    verified = {k: v for k, v in doc_outcomes().items() if k != ("Engine", "Release")}
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"^\| (vLLM|SGLang|lmdeploy|aphrodite-engine) \| ([0-9][^|]*) \| "
                     r"`([^`]*)` \| `([^`]*)` \| `([^`]*)` \|$", line)
        if m:
            rows[(m[1], m[2].strip())] = {"none": m[3], "raise": m[4], "auto": m[5]}
    assert rows, "README has no verified engine rows"
    assert rows == verified


def test_layout_section_lists_exactly_the_package_files():
    """The README's Layout section and the package tree name the same modules."""
    import re

    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    listed = set(re.findall(r"^\s+(_\w+\.py|\w+/)\s", layout, re.M))
    pkg = ROOT / "flashinfer_safe_workspace"
    present = {p.name for p in pkg.glob("_*.py")} - {"__init__.py", "__main__.py", "_version.py"}
    present |= {p.name + "/" for p in pkg.iterdir() if p.is_dir() and not p.name.startswith("__")}
    listed.discard("flashinfer_safe_workspace/")
    assert listed == present, (sorted(listed - present), sorted(present - listed))
