"""Fetch a few source files of a released engine wheel into a cache outside the repo.

No engine code is committed: at test time pip (the ordinary client) resolves the
wheel's URL on PyPI (``pip install --dry-run --no-deps --report``), then only the
zip's central directory and the wanted members are read with HTTP range requests
(a vLLM wheel is 300-450 MB; the files needed are a few hundred KB). If the server
refuses ranges, the whole wheel is downloaded with ``pip download`` when it is at
most ``MAX_FULL_MB``. Member CRCs are checked by ``zipfile``.

Cache: ``$FIWS_ENGINE_CACHE`` or ``~/.cache/fiws-engines/<dist>-<version>/`` holding
the extracted files under their wheel paths plus ``SOURCE.json`` (URL, members).
Everything is bounded by timeouts; failures raise :class:`Unavailable` (tests skip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

TIMEOUT = 180  # seconds for any one network step
MAX_FULL_MB = 500


class Unavailable(RuntimeError):
    """The wheel or a member could not be fetched (offline, yanked, renamed file)."""


def cache_root() -> Path:
    root = os.environ.get("FIWS_ENGINE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "fiws-engines"


def wheel_url(dist: str, version: str) -> str:
    """The URL pip would download for ``dist==version`` on this interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
               "--ignore-installed", "--only-binary=:all:", "--quiet", "--report",
               str(report), f"{dist}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip could not resolve {dist}=={version} within {TIMEOUT} s")
        if proc.returncode != 0 or not report.exists():
            raise Unavailable(f"pip could not resolve {dist}=={version}: "
                              f"{(proc.stderr or proc.stdout).strip()[-300:]}")
        data = json.loads(report.read_text())
    for item in data.get("install", []):
        url = item.get("download_info", {}).get("url", "")
        if url.endswith(".whl"):
            return url
    raise Unavailable(f"pip resolved no wheel for {dist}=={version}")


class _HttpRangeFile:
    """A read-only, seekable file over HTTP range requests (block-cached)."""

    BLOCK = 1 << 18

    def __init__(self, url: str):
        self.url, self.pos, self.blocks, self.fetched = url, 0, {}, 0
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            self.size = int(resp.headers["Content-Length"])
            if resp.headers.get("Accept-Ranges", "").lower() != "bytes":
                raise Unavailable("server does not accept byte ranges")

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def _block(self, index: int) -> bytes:
        block = self.blocks.get(index)
        if block is None:
            start = index * self.BLOCK
            end = min(start + self.BLOCK, self.size) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                if resp.status != 206:
                    raise Unavailable(f"range request answered {resp.status}")
                block = resp.read()
            self.fetched += len(block)
            self.blocks[index] = block
        return block

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        out = bytearray()
        while n > 0:
            index, offset = divmod(self.pos, self.BLOCK)
            chunk = self._block(index)[offset:offset + n]
            if not chunk:
                break
            out += chunk
            self.pos += len(chunk)
            n -= len(chunk)
        return bytes(out)


def _extract(zf: zipfile.ZipFile, members, dest: Path) -> None:
    names = set(zf.namelist())
    missing = [m for m in members if m not in names]
    if missing:
        raise Unavailable(f"not in the wheel: {missing}")
    for member in members:
        target = dest / member
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(zf.read(member))  # zipfile checks the CRC


def fetch(dist: str, version: str, members) -> Path:
    """Directory holding ``members`` (wheel paths) of ``dist==version``; cached."""
    members = sorted(set(members))
    dest = cache_root() / f"{dist}-{version}"
    marker = dest / "SOURCE.json"
    if marker.exists():
        have = json.loads(marker.read_text()).get("members", [])
        if set(members) <= set(have) and all((dest / m).is_file() for m in members):
            return dest
        members = sorted(set(members) | set(have))
    try:
        url = wheel_url(dist, version)
    except Unavailable:
        raise
    except Exception as exc:
        raise Unavailable(f"resolving {dist}=={version}: {type(exc).__name__}: {exc}")
    tmp = Path(tempfile.mkdtemp(prefix=f"{dist}-{version}-", dir=_ensure(cache_root())))
    how = "range"
    try:
        try:
            remote = _HttpRangeFile(url)
            _extract(zipfile.ZipFile(remote), members, tmp)
            fetched = remote.fetched
        except Unavailable as exc:
            if "not in the wheel" in str(exc):
                raise
            how, fetched = "full", _extract_full(dist, version, url, members, tmp)
        except OSError:
            how, fetched = "full", _extract_full(dist, version, url, members, tmp)
        (tmp / "SOURCE.json").write_text(json.dumps(
            {"dist": dist, "version": version, "url": url, "members": members,
             "fetched_bytes": fetched, "how": how}, indent=1))
        try:  # another suite (or worker) may have put its copy in place meanwhile: keep
            tmp.rename(dest)  # that one where it holds every member asked for
        except OSError:
            done = dest / "SOURCE.json"
            have = json.loads(done.read_text()).get("members", []) if done.exists() else []
            if set(members) <= set(have):
                shutil.rmtree(tmp, ignore_errors=True)
                return dest
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return dest
    except Unavailable:
        raise
    except Exception as exc:
        raise Unavailable(f"fetching {dist}=={version}: {type(exc).__name__}: {exc}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _extract_full(dist, version, url, members, dest: Path) -> int:
    """Fallback: ``pip download`` the whole wheel (bounded size), extract, delete it."""
    try:  # size first, where the server says it
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            size = int(resp.headers.get("Content-Length", "0"))
    except Exception:
        size = 0
    if size > MAX_FULL_MB << 20:
        raise Unavailable(f"{url.rsplit('/', 1)[-1]} is {size >> 20} MB (> {MAX_FULL_MB} MB) "
                          "and the server refused range reads")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "-d", tmp, f"{dist}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * TIMEOUT)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download {dist}=={version} timed out")
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise Unavailable(f"pip download {dist}=={version} failed: {proc.stderr[-300:]}")
        size = wheels[0].stat().st_size
        if size > MAX_FULL_MB << 20:
            raise Unavailable(f"{wheels[0].name} is {size >> 20} MB (> {MAX_FULL_MB} MB)")
        with zipfile.ZipFile(wheels[0]) as zf:
            _extract(zf, members, dest)
        return size
