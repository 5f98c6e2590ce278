"""``pip wheel .`` builds a wheel that carries every activation path and the license:
the ``.pth`` line and the ``.start`` file at the top of site-packages, the three engines'
plugin entry points, LICENSE, the version and the dependency bounds."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = out.glob("flashinfer_safe_workspace-*.whl")
    return zipfile.ZipFile(path)


def _dist_info(zf, name):
    (member,) = [n for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")
                 and n.endswith("/" + name)]
    return zf.read(member).decode()


def test_wheel_ships_pth_and_start_beside_each_other(wheel):
    names = set(wheel.namelist())
    assert {"flashinfer_safe_workspace.pth", "flashinfer_safe_workspace.start"} <= names
    assert wheel.read("flashinfer_safe_workspace.pth") == (
        ROOT / "flashinfer_safe_workspace.pth").read_bytes()
    assert wheel.read("flashinfer_safe_workspace.start") == (
        ROOT / "flashinfer_safe_workspace.start").read_bytes()


def test_wheel_declares_the_engines_entry_points(wheel):
    eps = configparser.ConfigParser()
    eps.optionxform = str
    eps.read_string(_dist_info(wheel, "entry_points.txt"))
    for group, function in (("vllm.general_plugins", "vllm_plugin"),
                            ("sglang.srt.plugins", "sglang_plugin"),
                            ("aphrodite.general_plugins", "aphrodite_plugin")):
        assert dict(eps[group]) == {
            "flashinfer_safe_workspace": f"flashinfer_safe_workspace.activation.gate:{function}"}


def test_wheel_carries_the_license_version_and_bounds(wheel):
    licenses = [n for n in wheel.namelist() if "/licenses/" in n and n.endswith("LICENSE")]
    assert licenses and wheel.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    meta = _dist_info(wheel, "METADATA")
    from flashinfer_safe_workspace._version import __version__

    assert f"\nVersion: {__version__}\n" in meta
    assert "License-Expression: Apache-2.0" in meta
    requires = [l.split(":", 1)[1].strip() for l in meta.splitlines()
                if l.startswith("Requires-Dist:") and "extra ==" not in l]
    by_name = {re.match(r"[A-Za-z0-9_.-]+", r).group(0): r for r in requires}
    assert by_name["flashinfer-python"].replace(" ", "") == "flashinfer-python>=0.5.0"  # no upper
    for name in ("torch", "cuda-python", "wrapt"):
        assert ">=" in by_name[name], by_name
    assert "gloo" not in meta.split("\n\n", 1)[0]  # the summary names the store, not gloo
