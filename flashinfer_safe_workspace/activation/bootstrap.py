"""Start-up: once per process, and as cheaply as possible, get ready to hook FlashInfer.

Runs from ``gate.activate`` (the ``.pth`` line, the ``.start`` file, the engines' plugin
entry points), only when the variable is set and not off; the first of them to run does the
work and names itself (``activated_by``), the others find it done. Never raises: start-up
of the host process must not depend on us.

Cost budget: with the variable on and a valid value, the common case in a launch where
most processes never touch FlashInfer, this imports nothing beyond ``sys``, ``os`` and
``_thread`` and inserts one meta-path entry. Settings are parsed, logging configured
and wrapt (≈60–100 ms) imported only when ``flashinfer`` itself is first imported.
"""

from __future__ import annotations

import _thread
import sys

_done = False
_lock = _thread.allocate_lock()
hooks_registered = False  # wrapt post-import hooks are in place
_activated_by = None  # the path that activated the shim in this process (see gate)


def activated_by():
    """``pth``, ``start``, ``plugin:vllm``, ``plugin:sglang``, ``plugin:aphrodite``,
    ``sitecustomize`` or ``install()``: the first path that activated the shim in this
    process; None while it is not active (and after ``uninstall()``)."""
    return _activated_by


def note_activation(path: str) -> None:
    """The shim became active through ``path``; the first path to do so keeps its name."""
    global _activated_by
    if _activated_by is None:
        _activated_by = path


def forget_activation() -> None:
    global _activated_by
    _activated_by = None


def watching() -> bool:
    """Enabled, and waiting for the first ``import flashinfer`` to finish activation."""
    return any(isinstance(f, _FlashInferWatcher) for f in sys.meta_path)


def main(path: str, plainly_on: bool) -> None:
    """Activate from the environment, once per process, on behalf of ``path``;
    ``plainly_on``: the gate found the switch in one of its "on" spellings."""
    global _done
    with _lock:
        if _done:  # .pth files run twice in venvs; a plugin after the .pth; etc.
            return
        _done = True
    try:
        if plainly_on and "flashinfer" not in sys.modules:
            sys.meta_path.insert(0, _FlashInferWatcher(path))  # the rest waits for flashinfer
            note_activation(path)
            return
        activate_from_settings(path)
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        _report("bootstrap", exc)


def activate_from_settings(path: str) -> None:
    """Parse Settings (warning once about bad values), configure logging, and if the
    shim is enabled, register the hooks."""
    from .. import _config, _log

    settings = _config.current()
    _log.configure(settings.debug)
    if settings.enabled:
        register_hooks(path)


def _report(site: str, exc: BaseException) -> None:
    try:
        from .._log import internal_error

        internal_error(site, exc)
    except Exception:  # noqa: BLE001
        pass


class _FlashInferWatcher:
    """A stdlib-only meta-path entry that does nothing but notice the first import of
    ``flashinfer``; it then removes itself and finishes activation (in time: the hooked
    ``flashinfer.comm`` submodules are imported after the package)."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer" or name.startswith("flashinfer."):
            try:
                sys.meta_path.remove(self)
            except ValueError:
                return None  # uninstalled meanwhile, or already handled
            try:
                activate_from_settings(self.path)
            except Exception as exc:  # noqa: BLE001 - never break the user's import
                _report("bootstrap.hooks", exc)
        return None  # let the real finders find it

    def invalidate_caches(self):
        pass


def stop_watching() -> None:
    for finder in [f for f in sys.meta_path if isinstance(f, _FlashInferWatcher)]:
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass


def register_hooks(path: str) -> None:
    """Wrap now if FlashInfer is imported, and again whenever its modules are imported;
    ``path`` names who asked (``activated_by``)."""
    global hooks_registered
    import wrapt

    from . import patch as _patch

    _patch.enable()
    note_activation(path)
    if not hooks_registered:
        hooks_registered = True
        for module_name in ("flashinfer.comm.trtllm_ar", "flashinfer.comm.allreduce", "flashinfer.comm"):
            wrapt.register_post_import_hook(_on_import, module_name)
    if "flashinfer.comm" in sys.modules or "flashinfer.comm.allreduce" in sys.modules:
        _patch.install_targets()


def _on_import(module) -> None:
    """Post-import hook body: must never raise (it would break the user's import)."""
    try:
        from . import patch as _patch

        if _patch.is_active():
            _patch.install_targets()
    except Exception as exc:  # noqa: BLE001
        _report("import-hook", exc)
