"""Start-up: once per process, read Settings and, when enabled, hook FlashInfer's import.

Runs from the ``.pth`` line (only when the variable is set and not off) and from
``import flashinfer_safe_workspace``. Never raises: start-up of the host process
must not depend on us. Imports wrapt only when enabled, and torch/flashinfer never.
"""

from __future__ import annotations

import sys
import threading

_done = False
_lock = threading.Lock()
hooks_registered = False  # wrapt post-import hooks are in place


def watching() -> bool:
    """Enabled, and waiting for the first ``import flashinfer`` to load wrapt."""
    return any(isinstance(f, _FlashInferWatcher) for f in sys.meta_path)


def main() -> None:
    global _done
    with _lock:
        if _done:  # .pth files run twice in venvs; import after .pth; etc.
            return
        _done = True
    try:
        from . import _config, _log

        settings = _config.current()
        _log.configure(settings.debug)
        if not settings.enabled:
            return
        if "flashinfer" in sys.modules:
            register_hooks()
        else:  # wrapt costs ~60 ms to import: wait until FlashInfer itself is imported
            from . import _patch

            _patch._active = True
            sys.meta_path.insert(0, _FlashInferWatcher())
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        try:
            from ._log import internal_error
            internal_error("bootstrap", exc)
        except Exception:
            pass


class _FlashInferWatcher:
    """A stdlib-only meta-path entry that does nothing but notice the first import of
    ``flashinfer``; it then removes itself and registers the wrapt post-import hooks
    (in time: the hooked ``flashinfer.comm`` submodules are imported after the package)."""

    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer" or name.startswith("flashinfer."):
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            try:
                from . import _patch

                if _patch.is_active():  # not uninstalled meanwhile
                    register_hooks()
            except Exception as exc:  # noqa: BLE001 - never break the user's import
                try:
                    from ._log import internal_error
                    internal_error("bootstrap.hooks", exc)
                except Exception:
                    pass
        return None  # let the real finders find it

    def invalidate_caches(self):
        pass


def register_hooks() -> None:
    """Wrap now if FlashInfer is imported, and again whenever its modules are imported."""
    global hooks_registered
    import wrapt

    from . import _patch

    _patch._active = True
    if not hooks_registered:
        hooks_registered = True
        for module_name in ("flashinfer.comm.trtllm_ar", "flashinfer.comm.allreduce", "flashinfer.comm"):
            wrapt.register_post_import_hook(_on_import, module_name)
    if "flashinfer.comm" in sys.modules or "flashinfer.comm.allreduce" in sys.modules:
        _patch.install_targets()


def _on_import(module) -> None:
    """Post-import hook body: must never raise (it would break the user's import)."""
    try:
        from . import _patch

        if _patch.is_active():
            _patch.install_targets()
    except Exception as exc:  # noqa: BLE001
        try:
            from ._log import internal_error
            internal_error("import-hook", exc)
        except Exception:
            pass
