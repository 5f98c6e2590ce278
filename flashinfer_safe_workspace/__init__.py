"""flashinfer_safe_workspace: create FlashInfer's all-reduce fusion workspace on every
rank or on none.

Activated by ``FLASHINFER_SAFE_WORKSPACE=1`` through the installed ``.pth`` line or
``.start`` file, or through an engine's plugin entry point (all of them call
``activation.gate``), or explicitly with :func:`install`. Importing the package activates
nothing by itself.

The modules form layers, and every import points down them: docs/design.md draws them
and holds the table that ``scripts/layers`` checks the imports against.
"""

from __future__ import annotations

from ._errors import WorkspaceVetoed
from ._version import __version__

__all__ = ["install", "uninstall", "is_installed", "WorkspaceVetoed", "__version__"]


def install(**overrides) -> None:
    """Activate the shim now, whatever the environment says; raise if it cannot.

    Keyword arguments override settings (``on_veto="raise"``, ``headroom_mb=256``, ...)
    with the same validation as the environment variables. Idempotent.
    """
    from .activation import bootstrap as _bootstrap
    from . import _config, _log

    from . import _decide

    settings = _config.reload(enabled=True, **overrides)
    _decide.clear_cache()  # vetoes were decided under the previous settings
    _log.configure(settings.debug)
    _bootstrap.stop_watching()
    _bootstrap.register_hooks("install()")


def uninstall() -> None:
    """Restore FlashInfer's original functions (where nothing else wrapped them since)
    and forget cached vetoes."""
    from .activation import bootstrap as _bootstrap, patch as _patch
    from . import _decide

    _bootstrap.stop_watching()
    _patch.uninstall_targets()
    _bootstrap.forget_activation()
    _decide.clear_cache()


def is_installed() -> bool:
    """Whether the shim is active (its hooks wrap FlashInfer as soon as it is imported)."""
    from .activation import bootstrap as _bootstrap

    if _bootstrap.watching():
        return True
    from .activation import patch as _patch

    return _patch.is_active()
