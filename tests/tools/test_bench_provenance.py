"""The benches name the commit they ran at (bench/_provenance.py), never a stale one, and
bench/startup builds its venvs from what the interpreter says its site dirs are."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
                                              GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
                          ).stdout.strip()


@pytest.fixture
def prov(tmp_path, monkeypatch):
    """_provenance pointed at a scratch repository with two commits."""
    mod = _load("bench_provenance", BENCH / "_provenance.py")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f").write_text("1")
    _git(repo, "add", "f")
    _git(repo, "commit", "-qm", "one")
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "f").write_text("2")
    _git(repo, "commit", "-qam", "two")
    monkeypatch.setattr(mod, "REPO", repo)
    monkeypatch.setattr(mod, "DEFAULT_FILE", repo / ".device" / "dist" / "COMMIT")
    monkeypatch.delenv(mod.ENV, raising=False)
    monkeypatch.delenv(mod.FILE_ENV, raising=False)
    mod.old = old
    mod.head = _git(repo, "rev-parse", "--short", "HEAD")
    return mod


def _write_commit_file(prov, commit, dirty=False):
    prov.DEFAULT_FILE.parent.mkdir(parents=True, exist_ok=True)
    prov.DEFAULT_FILE.write_text(json.dumps({"commit": commit, "dirty": dirty}))


def test_env_wins(prov, monkeypatch):
    monkeypatch.setenv(prov.ENV, "feedbee")
    _write_commit_file(prov, prov.old)
    assert prov.commit_info()["commit"] == "feedbee"


def test_a_clean_git_tree_wins_over_a_stale_commit_file(prov):
    _write_commit_file(prov, prov.old)
    info = prov.commit_info()
    assert info["commit"] == prov.head and info["commit_source"].startswith("git")


def test_a_commit_file_for_another_tree_is_refused(prov):
    _write_commit_file(prov, prov.old)
    (prov.REPO / "f").write_text("3")  # dirty, and not the file's commit either
    info = prov.commit_info()
    assert info["commit"] == "unknown"
    assert f"HEAD is {prov.head}" in info["commit_source"] and "ignored" in info["commit_source"]


def test_the_commit_file_names_a_tree_that_git_does_not_know(prov):
    """The device: its .git is older than its files (it does not know the commit)."""
    (prov.REPO / "f").write_text("3")
    _write_commit_file(prov, "0123456789abcdef0123456789abcdef01234567")
    assert prov.commit_info() == {"commit": "0123456",
                                  "commit_source": f"COMMIT file {prov.DEFAULT_FILE}"}


def test_no_git_uses_the_file_else_unknown(prov):
    shutil.rmtree(prov.REPO / ".git")
    assert prov.commit_info()["commit"] == "unknown"
    prov.DEFAULT_FILE.parent.mkdir(parents=True)
    prov.DEFAULT_FILE.write_text("abc1234\n")  # a bare hash is accepted too
    assert prov.commit_info()["commit"] == "abc1234"
    _write_commit_file(prov, "abc1234", dirty=True)
    assert prov.commit_info()["commit"] == "abc1234+dirty"


def test_command_is_quoted_as_run(prov):
    assert prov.command("bench/x", ["--note", "busy machine", "--n", "3"]) == \
        "bench/x --note 'busy machine' --n 3"


def _fake_wheel(path: Path) -> Path:
    whl = path / "flashinfer_safe_workspace-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("flashinfer_safe_workspace/__init__.py", "LOADED = True\n")
        zf.writestr("flashinfer_safe_workspace.pth",
                    'import os; "FLASHINFER_SAFE_WORKSPACE" in os.environ and '
                    '__import__("flashinfer_safe_workspace")\n')
        zf.writestr("flashinfer_safe_workspace-0.0.0.dist-info/METADATA", "Name: x\n")
        zf.writestr("flashinfer_safe_workspace-0.0.0.data/scripts/x", "#!/bin/sh\n")
    return whl


PYTHONS = [sys.executable] + [p for p in ("/usr/bin/python3",)  # Debian's: dist-packages
                              if os.path.exists(p) and os.path.realpath(p) !=
                              os.path.realpath(sys.executable)]


@pytest.mark.parametrize("python", PYTHONS)
def test_startup_venvs_on_this_interpreter(python, tmp_path):
    """bare cannot import the package; installed runs its .pth when the variable is set;
    the site dir is the venv's own (Debian's interpreter lists dist-packages dirs that do
    not exist, in a venv and out of it)."""
    if subprocess.run([python, "-c", "import venv"], capture_output=True).returncode:
        pytest.skip(f"{python} has no venv module")
    whl = _fake_wheel(tmp_path)
    code = f"""
import json, subprocess, sys
from pathlib import Path
import importlib.machinery, importlib.util
loader = importlib.machinery.SourceFileLoader("bench_startup", {str(BENCH / "startup")!r})
spec = importlib.util.spec_from_loader("bench_startup", loader)
m = importlib.util.module_from_spec(spec); loader.exec_module(m)
tmp = Path({str(tmp_path)!r})
env = {{"PATH": "/usr/bin:/bin"}}
bare = m.make_venv(tmp / "bare", env)
inst = m.make_venv(tmp / "inst", env, Path({str(whl)!r}))
ask = lambda py, c, e: subprocess.run([str(py), "-c", c], env=e, cwd="/", capture_output=True,
                                      text=True).stdout.strip()
on = dict(env, FLASHINFER_SAFE_WORKSPACE="1")
check = "import sys; print('flashinfer_safe_workspace' in sys.modules)"
print(json.dumps({{
  "bare_import": subprocess.run([str(bare), "-c", "import flashinfer_safe_workspace"], env=env,
                                cwd="/", capture_output=True).returncode == 0,
  "inst_unset": ask(inst, check, env), "inst_on": ask(inst, check, on),
  "site": str(m.venv_site_dir(inst, env)), "prefix": str(tmp / "inst"),
}}))
"""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bare_import"] is False
    assert (got["inst_unset"], got["inst_on"]) == ("False", "True")
    assert got["site"].startswith(got["prefix"])
