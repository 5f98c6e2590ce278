"""The layering measure (``scripts/layers``): its logic on tiny synthetic packages, and the
package itself against the layer table of docs/design.md (issue 24)."""

import importlib.machinery
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "layers"
DESIGN = ROOT / "docs" / "design.md"


def _load():
    loader = importlib.machinery.SourceFileLoader("fiws_layers_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


layers = _load()

TABLE = """\
# pkg

## Layers

| layer | modules |
|---|---|
| top | `__init__`, `app` |
| middle | `mid` |
| bottom | `base`, `util` |

text after the table
"""


def make(tmp_path, files: dict, table: str = TABLE):
    """A package ``pkg`` under tmp_path with ``files`` (relative path -> source) and a
    design file holding ``table``; returns (package dir, design path)."""
    pkg = tmp_path / "pkg"
    for rel, src in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    design = tmp_path / "design.md"
    design.write_text(table)
    return pkg, design


def edges(report):
    return {(i.source, i.target) for i in report.imports}


# ------------------------------------------------------------------ the package itself


def test_every_module_of_the_package_is_in_a_layer():
    """The table covers the package (a new top-level module must be placed)."""
    report = layers.measure(ROOT / "flashinfer_safe_workspace", DESIGN)
    assert len(report.modules) > 40 and "" in report.layer_of
    assert report.layer_of["_decide"][1] == "decide"
    assert report.layer_of["agreement.record"][1] == "vocabulary"  # longest prefix wins
    assert report.layer_of["agreement.driver"][1] == "agreement"


def test_the_package_has_no_cycle_and_no_upward_import():
    report = layers.measure(ROOT / "flashinfer_safe_workspace", DESIGN)
    shown = layers.render(report, "flashinfer_safe_workspace")
    assert (len(report.cycles), len(report.upward)) == (0, 0), shown


# ------------------------------------------------------------------ resolution


def test_relative_absolute_and_lazy_imports_resolve_to_package_modules(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "import os\nfrom collections import deque\n",
        "util.py": "from . import base\n",  # a submodule by name
        "mid/__init__.py": "from ..base import deque\n",  # a name in a module, two dots
        "mid/core.py": ("from .. import util, base\n"
                        "from . import helper\n"
                        "def f():\n    import pkg.app\n"),  # lazy, absolute
        "mid/helper.py": "from pkg.mid.core import f\n",  # absolute from-import of a name
        "app.py": "import pkg.mid.core as c\nfrom pkg import util\nfrom pkg.mid import *\n",
    })
    report = layers.measure(pkg, design)
    assert edges(report) == {
        ("util", "base"), ("mid", "base"), ("mid.core", "util"), ("mid.core", "base"),
        ("mid.core", "mid.helper"), ("mid.core", "app"), ("mid.helper", "mid.core"),
        ("app", "mid.core"), ("app", "util"), ("app", "mid")}
    lazy = {(i.source, i.target) for i in report.imports if i.lazy}
    assert lazy == {("mid.core", "app")}


def test_a_name_imported_from_a_package_init_points_at_the_init(tmp_path):
    pkg, design = make(tmp_path, {
        "__init__.py": "VALUE = 1\n",
        "base.py": "from . import VALUE\n",  # not a submodule: the package's __init__
        "util.py": "",
    })
    report = layers.measure(pkg, design)
    assert edges(report) == {("base", "")}
    assert [(u[0].source, u[1], u[2]) for u in report.upward] == [("base", "bottom", "top")]


def test_imports_of_other_packages_and_out_of_package_dots_are_ignored(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "import json\nimport pkgother\nfrom pkgother import x\nfrom ... import y\n",
        "util.py": "",
    })
    assert layers.measure(pkg, design).imports == []


# ------------------------------------------------------------------ cycles


def test_cycles_are_found_lazy_imports_included(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "from . import util\n",
        "util.py": "def f():\n    from . import base\n",  # lazy: still a cycle
        "mid/__init__.py": "",
        "mid/a.py": "from . import b\n",
        "mid/b.py": "from . import c\n",
        "mid/c.py": "class K:\n    def m(self):\n        from .a import K\n",
        "app.py": "from .mid import a\n",  # into a cycle, not part of it
    })
    report = layers.measure(pkg, design)
    assert report.cycles == [["mid.a", "mid.b", "mid.c"], ["base", "util"]]
    assert report.upward == [] and report.failed
    text = layers.render(report, "pkg")
    assert "cycle 1 (3 modules): pkg.mid.a, pkg.mid.b, pkg.mid.c" in text
    assert "pkg/util.py:2  -> pkg.base (lazy)" in text


def test_an_acyclic_graph_has_no_cycle(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "", "util.py": "from . import base\n",
        "mid/__init__.py": "from .. import base, util\n",
        "app.py": "from . import mid, util, base\n",
    })
    report = layers.measure(pkg, design)
    assert report.cycles == [] and report.upward == [] and not report.failed


# ------------------------------------------------------------------ layers


def test_upward_imports_are_listed_with_file_and_line(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "\n\ndef f():\n    from .mid import thing\n",
        "util.py": "from . import base\n",  # same layer: allowed
        "mid/__init__.py": "from ..app import go\n",
        "app.py": "go = 1\n",
    })
    report = layers.measure(pkg, design)
    found = sorted((u[0].path, u[0].line, u[0].target, u[1], u[2], u[0].lazy) for u in report.upward)
    assert found == [("pkg/base.py", 4, "mid", "bottom", "middle", True),
                     ("pkg/mid/__init__.py", 1, "app", "middle", "top", False)]
    assert report.cycles == []
    text = layers.render(report, "pkg")
    assert "pkg/base.py:4  pkg.mid  [bottom -> middle] (lazy)" in text
    assert text.splitlines()[-1].endswith("0 cycles (0 modules in them), 2 upward imports")


def test_the_longest_prefix_decides_a_module_layer(tmp_path):
    table = TABLE.replace("| `base`, `util` |", "| `base`, `util`, `mid.words` |")
    pkg, design = make(tmp_path, {
        "mid/__init__.py": "", "mid/words.py": "", "mid/core.py": "from . import words\n",
        "base.py": "from .mid import words\n", "util.py": "",
    }, table)
    report = layers.measure(pkg, design)
    assert report.layer_of["mid.words"][1] == "bottom" and report.layer_of["mid.core"][1] == "middle"
    assert report.upward == []


def test_a_module_in_no_layer_and_a_prefix_named_twice_are_refused(tmp_path):
    pkg, design = make(tmp_path, {"base.py": "", "util.py": "", "stray.py": ""})
    with pytest.raises(ValueError, match="'stray' is in no layer"):
        layers.measure(pkg, design)
    twice = TABLE.replace("| `mid` |", "| `mid`, `base` |")
    pkg, design = make(tmp_path / "b", {"base.py": "", "util.py": ""}, twice)
    with pytest.raises(ValueError, match="names `base` twice"):
        layers.measure(pkg, design)


def test_the_table_is_read_top_row_first(tmp_path):
    _, design = make(tmp_path, {})
    assert layers.read_layers(design) == [
        ("top", ["__init__", "app"]), ("middle", ["mid"]), ("bottom", ["base", "util"])]
    design.write_text("# no table here\n")
    with pytest.raises(ValueError, match="no '## Layers' heading"):
        layers.read_layers(design)


def test_exit_status(tmp_path, capsys):
    clean, design = make(tmp_path / "a", {"base.py": "", "util.py": "from . import base\n"})
    assert layers.main(["--package", str(clean), "--design", str(design)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("totals: 3 modules, 1 imports")
    up, design = make(tmp_path / "b", {"base.py": "from . import app\n", "util.py": "",
                                       "app.py": ""})
    assert layers.main(["--package", str(up), "--design", str(design)]) == 1
    bad, design = make(tmp_path / "c", {"base.py": "", "util.py": "", "odd.py": ""})
    assert layers.main(["--package", str(bad), "--design", str(design)]) == 2
    assert "in no layer" in capsys.readouterr().err


# ------------------------------------------------------------------ callables handed down


def test_callables_handed_to_a_lower_layer_are_listed(tmp_path):
    pkg, design = make(tmp_path, {
        "base.py": "def run(fn):\n    return fn()\n",
        "util.py": "from . import base\ndef h():\n    pass\nbase.run(h)\n",  # same layer
        "mid/__init__.py": ("from .. import base\nfrom ..base import run\n"
                            "def f():\n    pass\n"
                            "base.run(f)\nrun(lambda: 1)\nbase.run(len)\nbase.run(f())\n"),
        "app.py": "from . import mid as m\nfrom .mid import f\nimport pkg.base as b\nb.run(m.f)\n",
    })
    found = {(h.source, h.callee, h.what, h.line)
             for h in layers.handed_down(pkg, design, tmp_path)}
    assert found == {("mid", "base", "mid.f", 5), ("mid", "base", "lambda", 6),
                     ("app", "base", "mid.f", 4)}


def test_the_package_hands_down_only_the_comparison_and_the_cache_reset():
    """What lets a call climb back up with 0 upward imports (docs/design.md walks kwargs
    through them): the cross-rank comparison handed to the vote, and the veto cache's
    reset handed to the store (run when the default group is replaced)."""
    found = {(h.source, h.callee, h.what)
             for h in layers.handed_down(ROOT / "flashinfer_safe_workspace", DESIGN, ROOT)}
    assert found == {("_decide", "agreement.vote", "checks.compare"),
                     ("_decide", "agreement.store", "_decide.clear_cache")}
