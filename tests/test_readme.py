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


def _layout_tree(text: str) -> list:
    """The paths the README's Layout block names, in order, once per mention: an indented
    tree, two spaces a level; a line indented deeper than one level below the folder
    above it continues the description before it."""
    import re

    block = text[text.index("## Layout"):]
    block = block[:block.index("\n## ", 4)] if "\n## " in block[4:] else block
    stack, out = [], []
    for line in block.splitlines():
        m = re.match(r"^    ( *)(\S+)(\s|$)", line)
        if not m or not re.match(r"^[\w.]+/?$", m.group(2)):
            continue
        depth = len(m.group(1)) // 2
        if depth > len(stack):
            continue  # a wrapped description
        del stack[depth:]
        name = m.group(2)
        path = "/".join(stack + [name.rstrip("/")])
        out.append(path + ("/" if name.endswith("/") else ""))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return out


def _package_tree() -> set:
    pkg = ROOT / "flashinfer_safe_workspace"
    present = {"flashinfer_safe_workspace/", "flashinfer_safe_workspace.pth",
               "flashinfer_safe_workspace.start"}
    for path in pkg.rglob("*"):
        if "__pycache__" in path.parts or (path.is_file() and path.suffix != ".py"):
            continue
        rel = "flashinfer_safe_workspace/" + str(path.relative_to(pkg))
        present.add(rel + "/" if path.is_dir() else rel)
    return present


def test_layout_section_is_the_package_tree():
    """The README's Layout block names every module and folder of the package, in place,
    and each exactly once."""
    listed = _layout_tree((ROOT / "README.md").read_text())
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"listed more than once: {twice}"
    present = _package_tree()
    assert set(listed) == present, (sorted(set(listed) - present), sorted(present - set(listed)))


def test_layout_parser_sees_a_duplicate_and_skips_wrapped_descriptions():
    """The parser the layout test relies on: a module named twice is named twice, and a
    wrapped description line is not a module."""
    block = ("## Layout\n\n"
             "    pkg/\n"
             "      a.py          one\n"
             "                    and more words\n"
             "      sub/\n"
             "        b.py        two\n"
             "      a.py          again\n")
    assert _layout_tree(block) == ["pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.py", "pkg/a.py"]
