"""The tests exercise the installed wheel, never the working tree's package."""

import sys
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "flashinfer_safe_workspace"  # the working tree's copy


def _site_packages(path: str) -> bool:
    return "site-packages" in Path(path).parts or "dist-packages" in Path(path).parts


def test_this_process_imports_the_installed_package():
    import flashinfer_safe_workspace as fiws

    where = Path(fiws.__file__).resolve()
    assert _site_packages(str(where)), where
    assert TREE not in where.parents, f"{where} is the working tree, not the wheel"


def test_child_processes_import_the_installed_package():
    proc = harness.run_python(
        "import flashinfer_safe_workspace as f; print(f.__file__)", timeout=300)
    assert proc.returncode == 0, proc.stderr
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    assert _site_packages(str(where)) and TREE not in where.parents, where


def test_the_wheel_ships_the_pth_pre_gate():
    pth = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages" / "flashinfer_safe_workspace.pth"
    assert pth.exists(), pth
    assert pth.read_text() == (ROOT / "flashinfer_safe_workspace.pth").read_text()


def test_the_wheel_ships_the_start_file():
    start = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages" / "flashinfer_safe_workspace.start"
    assert start.exists(), start
    assert start.read_text() == (ROOT / "flashinfer_safe_workspace.start").read_text()
