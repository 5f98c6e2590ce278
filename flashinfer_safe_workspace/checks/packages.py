"""Mode 11: flashinfer-cubin / flashinfer-jit-cache at another version than flashinfer-python.

Up to 0.7.1 a mismatch raises at ``import flashinfer`` (the shim never runs then, unless
FLASHINFER_DISABLE_VERSION_CHECK is set); from 0.7.2 FlashInfer ignores the package and
JIT-compiles the comm module inside creation, between the handle exchange and the
barrier (minutes) while the peers wait. Vetoed locally on a mismatch; compared across
ranks (different installs build different kernels)."""

from __future__ import annotations

from .. import _reasons as R
from .base import differ, every_release, fail, ok, whole_value

NAME = "packages"
CODE = R.PACKAGE_MISMATCH
MODES = (11,)
RELEASES = "every release (raise at import to 0.7.1; JIT inside creation from 0.7.2)"


applies = every_release


def _matches(python: str, other: str) -> bool:
    """Whether ``other`` is built for ``python``'s release: the same version once local tags
    (``+cu129``) are dropped; an absent package matches."""
    if not other or not python:
        return True
    return other.split("+")[0] == python.split("+")[0]


def local(ctx):
    versions = dict(ctx.facts().packages)
    python = versions.get("flashinfer-python", "") or ctx.version or ""
    short = {"flashinfer-python": "python", "flashinfer-cubin": "cubin",
             "flashinfer-jit-cache": "jit"}
    value = " ".join(f"{short[n]}={versions.get(n) or '-'}" for n in short)
    bad = [n for n in ("flashinfer-cubin", "flashinfer-jit-cache")
           if not _matches(python, versions.get(n, ""))]
    if bad:
        return fail(R.PACKAGE_MISMATCH, value,
                    f"{', '.join(f'{n} {versions[n]}' for n in bad)} does not match "
                    f"flashinfer-python {python}: install matching versions")
    return ok(value)


def compare(records):
    return differ(records, NAME, whole_value, R.PACKAGE_MISMATCH,
                  "FlashInfer packages differ between ranks")
