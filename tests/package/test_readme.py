"""The README's commands are the ones CI runs; the docs' checked tables and links hold."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands():
    """The README's two set-up commands, in order: the demo (right after the first screen)
    and the tests (under Developing)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return [l.strip() for l in lines if l.startswith("    python3 -m venv")]


def test_readme_has_the_demo_then_the_test_command():
    commands = _commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "flashinfer_safe_workspace demo --world-size 2 --starve-rank 0" in demo
    assert "pytest" in tests
    assert "torch==2.13.0" in demo and "torch==2.13.0" in tests


def test_readme_is_a_front_door():
    """At most about 200 lines. Its first screen (30 lines) carries the serving engineer's
    path: the hang it prevents, what it costs, an install that works from a clone (not the
    PyPI name, which has no release), the variable under vLLM and SGLang, `doctor` with
    every exit code, and the page for a veto. Further down: where the decision line shows,
    and the CPU wheel of torch."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    screen = "\n".join(lines[:30])
    for needed in ("NCCL watchdog", "**Cost**", "    pip install .\n",
                   "FLASHINFER_SAFE_WORKSPACE=1 vllm serve",
                   "FLASHINFER_SAFE_WORKSPACE=1 python -m sglang.launch_server",
                   "flashinfer-safe-workspace doctor", "**0**", "**1**", "**2**", "**3**",
                   "(docs/when-it-vetoes.md)"):
        assert needed in screen + "\n", needed
    assert "pip install flashinfer-safe-workspace" not in text
    for needed in ("## Seeing the decision line", "FLASHINFER_SAFE_WORKSPACE_DEBUG=1",
                   "## Developing", "download.pytorch.org/whl/cpu"):
        assert needed in text, needed


def test_ci_runs_exactly_the_readme_test_command():
    tests = _commands()[1]
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
          if l.strip() and not l.startswith("#")]
    assert tests in ci


def test_on_veto_engine_rows_match_the_verified_table():
    import re
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "engines"))
    from _runner import doc_outcomes

    verified = {k: v for k, v in doc_outcomes().items() if k != ("Engine", "Release")}
    rows = {}
    for line in (ROOT / "docs" / "on-veto.md").read_text().splitlines():
        m = re.match(r"^\| (vLLM|SGLang|lmdeploy|aphrodite-engine) \| ([0-9][^|]*) \| "
                     r"`([^`]*)` \| `([^`]*)` \| `([^`]*)` \|$", line)
        if m:
            rows[(m[1], m[2].strip())] = {"none": m[3], "raise": m[4], "auto": m[5]}
    assert rows, "docs/on-veto.md has no verified engine rows"
    assert rows == verified


def _layout_tree(text: str) -> list:
    """The paths the Layout block (docs/layout.md) names, in order, once per mention: an indented
    tree, two spaces a level; a line indented deeper than one level below the folder
    above it continues the description before it."""
    import re

    block = text[text.index("# Layout"):]
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
    """The Layout block (docs/layout.md) names every module and folder of the package, in
    place, and each exactly once."""
    listed = _layout_tree((ROOT / "docs" / "layout.md").read_text())
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


# ----------------------------------------------------------------------------- relative links

_LINK = r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"


def _prose(text: str, inline: bool = True) -> str:
    """The text with fenced and indented code blocks (and, with ``inline``, inline code)
    blanked out: a link written inside code is an example, not a link."""
    import re

    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        elif fenced or line.startswith("    ") or line.startswith("\t"):
            out.append("")
        else:
            out.append(re.sub(r"`[^`]*`", "", line) if inline else line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    import re

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set:
    import re

    seen, anchors = {}, set()
    for line in _prose(path.read_text(), inline=False).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


_REPO_PATH = (r"`((?:docs|bench|scripts|tests|flashinfer_safe_workspace|sitecustomize_example|\.ci)"
              r"/[^`\s]*)`")


def broken_links(page: Path, root: Path = ROOT) -> list:
    """Every relative link of a Markdown page whose file, folder or heading is missing, and
    every repository path written as code (`docs/gpu/…/`, from the repository's root) that
    does not exist; a path with a wildcard or placeholder, or a test id's ``::`` part, is
    taken as far as it is literal, and a ``:LINE`` suffix is dropped."""
    import re

    bad = []
    for path in re.findall(_REPO_PATH, _prose(page.read_text(), inline=False)):
        literal = re.sub(r":\d+(?:-\d+)?$", "", path.split("::")[0])  # file:line
        if not re.search(r"[*…<>{}\[\]]", literal) and not (root / literal).exists():
            bad.append(f"`{path}` (no such path)")
    for target in re.findall(_LINK, _prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor})")
    return bad


def _pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "CHANGELOG.md",
            ROOT / "bench" / "RESULTS.md"]


def test_every_relative_link_resolves():
    """Every relative link in README.md, docs/**/*.md, CHANGELOG.md and bench/RESULTS.md
    names a file or folder that exists, and a heading of it where it names one; every
    repository path they write as code exists."""
    pages = _pages()
    assert len(pages) > 10 and all(p.exists() for p in pages)
    bad = {str(p.relative_to(ROOT)): broken_links(p) for p in pages}
    assert {k: v for k, v in bad.items() if v} == {}


def test_link_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    """The checker the link test relies on: a missing file, a missing heading, a heading of
    the page itself, a repository path written as code that is gone; links inside code are
    skipped, and a heading with code and punctuation gets GitHub's anchor."""
    (tmp_path / "other.md").write_text("# Other\n\n## The `ON_VETO` table, per engine\n")
    (tmp_path / "docs" / "gpu" / "kept").mkdir(parents=True)
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## Seeing it\n\n"
                    "[a](other.md) [b](other.md#the-on_veto-table-per-engine) [c](#seeing-it)\n"
                    "[d](gone.md) [e](other.md#nowhere) [f](#top-2) [g](https://example.org/x)\n"
                    "`[h](gone-too.md)`\n\n    [i](gone-three.md)\n"
                    "`docs/gpu/kept/` `docs/gpu/pruned/` `docs/gpu/*.jsonl` `tests/t.py::test_x`\n")
    assert broken_links(page, root=tmp_path) == [
        "`docs/gpu/pruned/` (no such path)", "`tests/t.py::test_x` (no such path)",
        "gone.md (no such file)", "other.md#nowhere (no heading #nowhere)",
        "#top-2 (no heading #top-2)"]
