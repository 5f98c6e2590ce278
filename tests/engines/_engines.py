"""Which engine releases are verified, which of their files are fetched, and small
readers of those files (constants by ``ast.literal_eval``, call-site shapes by ``ast``).

The fetched files are the engines' own; nothing of them is committed here.
"""

from __future__ import annotations

import ast
from pathlib import Path

VLLM_FI = "vllm/distributed/device_communicators/flashinfer_all_reduce.py"
VLLM_PASS = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
VLLM_015_PASS = "vllm/compilation/collective_fusion.py"
SGL_FI = "sglang/srt/layers/flashinfer_comm_fusion.py"
SGL_LN = "sglang/srt/layers/layernorm.py"
SGL_COMM = "sglang/srt/layers/communicator.py"
APH_FI = "aphrodite/distributed/device_communicators/flashinfer_all_reduce.py"
APH_PASS = "aphrodite/compilation/passes/fusion/allreduce_rms_fusion.py"
LMD_FI = "lmdeploy/pytorch/backends/cuda/comm/flashinfer_allreduce.py"
# the engines' plugin loaders (tests/engines/test_plugins.py runs them)
VLLM_PLUGINS = "vllm/plugins/__init__.py"
SGL_PLUGINS = ["sglang/srt/plugins/__init__.py", "sglang/srt/plugins/hook_registry.py",
               "sglang/srt/environ.py"]
APH_PLUGINS = "aphrodite/plugins/__init__.py"

# (dist, version) -> wheel members to fetch
ENGINES = {
    ("vllm", "0.33.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py", "vllm/utils/gpu_sync_debug.py",
                         "vllm/distributed/device_communicators/all_reduce_utils.py",
                         VLLM_PLUGINS],
    ("vllm", "0.26.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py"],
    ("vllm", "0.22.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py"],
    ("vllm", "0.20.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py"],
    ("vllm", "0.18.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py"],
    ("vllm", "0.17.0"): [VLLM_FI, VLLM_PASS, "vllm/envs.py"],
    ("vllm", "0.15.0"): [VLLM_015_PASS, "vllm/envs.py"],
    ("aphrodite-engine", "0.24.1"): [
        APH_FI, APH_PASS, "aphrodite/envs.py",
        "aphrodite/distributed/device_communicators/all_reduce_utils.py", APH_PLUGINS],
    ("lmdeploy", "0.18.0"): [LMD_FI],
    ("sglang", "0.5.23"): [SGL_FI, *SGL_PLUGINS],
    ("sglang", "0.5.19"): [SGL_FI, SGL_LN, SGL_COMM, "sglang/srt/environ.py"],
    ("sglang", "0.5.17"): [SGL_FI, SGL_LN, SGL_COMM, "sglang/srt/environ.py"],
    ("sglang", "0.5.14"): [SGL_FI, SGL_LN, SGL_COMM, "sglang/srt/environ.py"],
    ("sglang", "0.5.8"): [SGL_FI],
    ("sglang", "0.5.10.post1"): [SGL_FI, "sglang/srt/environ.py"],
}


def literal(path: Path, name: str):
    """The value of a module-level ``NAME = <literal>`` (or annotated) in ``path``."""
    tree = ast.parse(Path(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name and node.value is not None):
            return ast.literal_eval(node.value)
    raise KeyError(f"{name} not found in {path}")


def _calls(node, name: str):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if (isinstance(f, ast.Name) and f.id == name) or (
                    isinstance(f, ast.Attribute) and f.attr == name):
                yield sub


def call_keywords(path: Path, function: str, callee: str) -> list:
    """The keyword names of each call of ``callee`` inside module-level ``function``
    (vLLM 0.22's ``_create_workspace`` passes ``comm_backend=`` and no ``group=``)."""
    tree = ast.parse(Path(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [sorted(k.arg for k in c.keywords if k.arg) for c in _calls(node, callee)]
    raise KeyError(function)


def _method(tree, cls: str, method: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    raise KeyError(f"{cls}.{method}")


def none_check_disables(path: Path, cls: str, method: str, callee: str) -> bool:
    """``cls.method`` has ``if callee(...) is None: ... return`` (vLLM >= 0.20 pass)."""
    fn = _method(ast.parse(Path(path).read_text()), cls, method)
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        t = node.test
        if (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Is)
                and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None
                and isinstance(t.left, ast.Call) and list(_calls(t.left, callee))
                and isinstance(node.body[-1], ast.Return)):
            return True
    return False


def guarded_by_except_exception(path: Path, cls: str, method: str, callee: str) -> bool:
    """Every call of ``callee`` (by name, or through a loop over a list naming it) in
    ``cls.method`` sits in a ``try`` whose handler catches ``Exception`` and returns."""
    fn = _method(ast.parse(Path(path).read_text()), cls, method)
    names = {callee}
    for node in ast.walk(fn):  # for fn in [callee, ...]: try: fn(...)
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.List, ast.Tuple)):
            if any(isinstance(e, ast.Name) and e.id == callee for e in node.iter.elts):
                if isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    found = False
    for node in ast.walk(fn):
        if not isinstance(node, ast.Try):
            continue
        calls = [c for stmt in node.body for n in names for c in _calls(stmt, n)]
        if not calls:
            continue
        found = True
        ok = any(isinstance(h.type, ast.Name) and h.type.id == "Exception"
                 and any(isinstance(s, ast.Return) for s in ast.walk(h)) for h in node.handlers)
        if not ok:
            return False
    return found


def gate_requires_not(path: Path, function: str, callee: str) -> bool:
    """Module-level ``function`` returns an ``and`` chain with ``not callee()`` in it
    (SGLang's ``apply_flashinfer_allreduce_fusion``: defer the all-reduce to the fused
    norm only while fusion is not marked unavailable)."""
    tree = ast.parse(Path(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for sub in ast.walk(node):
                if (isinstance(sub, ast.UnaryOp) and isinstance(sub.op, ast.Not)
                        and list(_calls(sub.operand, callee))):
                    return True
    return False


def asserts_workspace(path: Path) -> bool:
    """Some function of the module asserts ``workspace is not None`` (vLLM's fused
    all-reduce custom op, which a cached compiled graph calls without the pass's
    ``__init__`` having run)."""
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Assert):
            t = node.test
            if (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
                    and t.left.id == "workspace" and isinstance(t.ops[0], ast.IsNot)):
                return True
    return False


def class_defines(path: Path, cls: str, method: str) -> bool:
    tree = ast.parse(Path(path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return any(isinstance(i, ast.FunctionDef) and i.name == method for i in node.body)
    raise KeyError(cls)
