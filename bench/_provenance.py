"""Which commit a bench ran at, and the command that ran it (shared by bench/*).

The commit, first answer wins:

1. ``FIWS_COMMIT`` in the environment: the caller says it (a device command built on
   this machine, where git knows it);
2. git, when it names this tree exactly: ``HEAD`` with no tracked file changed;
3. the COMMIT file (``FIWS_COMMIT_FILE``, default ``.device/dist/COMMIT``, the file that
   ``scripts/gpu-check --prepare-wheel`` writes beside the wheel: JSON with ``commit`` and
   ``dirty``, or a bare hash). It is refused when git knows that commit and this tree is
   not it (a file left over from an older wheel);
4. ``unknown``: the source then says git's ``HEAD`` where tracked files differ from it.

A device copy's own ``.git`` may be older than its files (it read bf9c080 on the device
while the files were 95c7fb0 and 0f2ed41): its ``HEAD`` is taken only where it names the
files exactly, so a stale one is never the answer.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = "FIWS_COMMIT"
FILE_ENV = "FIWS_COMMIT_FILE"
DEFAULT_FILE = REPO / ".device" / "dist" / "COMMIT"


def _git(*args: str):
    try:
        p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p


def _git_head():
    """(short HEAD, dirty) or None where git cannot read this tree."""
    p = _git("rev-parse", "--short", "HEAD")
    if p is None or p.returncode != 0 or not p.stdout.strip():
        return None
    s = _git("status", "--porcelain", "--untracked-files=no")
    if s is None or s.returncode != 0:
        return None
    return p.stdout.strip(), bool(s.stdout.strip())


def _read_file(path: Path):
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return {"commit": text.split()[0], "dirty": False}
    if isinstance(info, dict) and info.get("commit"):
        return {"commit": str(info["commit"]), "dirty": bool(info.get("dirty"))}
    return None


def _tree_is(commit: str):
    """True / False where git knows ``commit``; None where it does not (a stale .git)."""
    known = _git("cat-file", "-e", f"{commit}^{{commit}}")
    if known is None or known.returncode != 0:
        return None
    same = _git("diff", "--quiet", commit, "--")
    if same is None:
        return None
    return same.returncode == 0


def commit_info() -> dict:
    """{"commit": ..., "commit_source": ...}; "unknown" where nothing names it."""
    env = os.environ.get(ENV, "").strip()
    if env:
        return {"commit": env, "commit_source": f"environment {ENV}"}
    head = _git_head()
    if head and not head[1]:
        return {"commit": head[0], "commit_source": "git (HEAD, no tracked file changed)"}
    path = Path(os.environ.get(FILE_ENV) or DEFAULT_FILE)
    info = _read_file(path)
    rejected = ""
    if info:
        commit = info["commit"]
        if len(commit) == 40:
            commit = commit[:7]
        if head is not None and _tree_is(info["commit"]) is False:
            rejected = f"; {path} names {commit}, which this tree is not (ignored)"
        else:
            return {"commit": commit + ("+dirty" if info["dirty"] else ""),
                    "commit_source": f"COMMIT file {path}"}
    if head:  # a tree that is no commit (or a stale .git): HEAD is said, not taken
        return {"commit": "unknown",
                "commit_source": f"git HEAD is {head[0]}, but tracked files differ from it "
                                 f"(set {ENV})" + rejected}
    return {"commit": "unknown",
            "commit_source": f"none (no {ENV}, no usable git, no {path})" + rejected}


def command(script: str, argv=None) -> str:
    """The command line as run, quoted so that it can be pasted back."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(shlex.quote(a) for a in [script, *args])
