"""Install and uninstall the wrappers in every FlashInfer namespace that binds the targets.

One proxy per target function, assigned to every module attribute that holds the
original (the defining module, the ``flashinfer.comm`` re-export, ``allreduce``'s
binding of the legacy function, any other ``flashinfer.*`` module). Restore is
identity-checked: an attribute is put back only if it still holds our proxy.
"""

from __future__ import annotations

import sys
import threading

from .._log import logger, rank_tag

# (defining module, function name, entry)
TARGETS = (
    ("flashinfer.comm.allreduce", "create_allreduce_fusion_workspace", "unified"),
    ("flashinfer.comm.trtllm_ar", "trtllm_create_ipc_workspace_for_all_reduce_fusion", "legacy"),
)
# namespaces known to re-export or bind the targets (reference section 6)
KNOWN_ALIASES = ("flashinfer.comm", "flashinfer.comm.allreduce", "flashinfer.comm.trtllm_ar")

_lock = threading.RLock()
_proxies: dict = {}  # name -> (original, proxy)
_active = False
MARK = "_self_flashinfer_safe_workspace"


def is_ours(obj) -> bool:
    try:
        return bool(getattr(obj, MARK, False))
    except Exception:
        return False


def _proxy_for(name: str, original, entry: str):
    import wrapt

    from .._wrapper import make_wrapper

    have = _proxies.get(name)
    if have is not None and have[0] is original:
        return have[1]
    proxy = wrapt.FunctionWrapper(original, make_wrapper(entry))
    setattr(proxy, MARK, True)  # _self_ prefix: stored on the proxy, not the function
    _proxies[name] = (original, proxy)
    return proxy


def _unwrap_ours(obj):
    while is_ours(obj):
        obj = obj.__wrapped__
    return obj


def install_targets() -> int:
    """Wrap every binding of the targets among the imported ``flashinfer`` modules.

    Idempotent: bindings that already hold our proxy are left alone. Returns the number
    of bindings newly wrapped. Raises if a defining module is imported but lacks its target
    only when neither target could be found.
    """
    global _active
    count = 0
    originals = []
    with _lock:
        _active = True
        for module_name, attr, entry in TARGETS:
            defining = sys.modules.get(module_name)
            if defining is None:
                continue
            current = getattr(defining, attr, None)
            if current is None:
                continue  # this release has no such function (e.g. 0.5.x unified API)
            original = _unwrap_ours(current)
            originals.append(original)
            proxy = _proxy_for(attr, original, entry)
            for mod_name in _candidate_modules():
                module = sys.modules.get(mod_name)
                if module is None:
                    continue
                try:
                    held = module.__dict__.get(attr)
                except Exception:
                    continue
                if held is original:
                    setattr(module, attr, proxy)
                    count += 1
        if count:
            logger.debug("%s wrapped %d FlashInfer binding(s)", rank_tag(), count)
    if count:  # a head start for the first decision (imports, store lines); never raises
        from .. import _prepare

        _prepare.prepare(originals)
    return count


def _candidate_modules():
    names = set(KNOWN_ALIASES)
    for name in list(sys.modules):
        if name == "flashinfer" or name.startswith("flashinfer."):
            names.add(name)
    return sorted(names)


def uninstall_targets() -> int:
    """Put the originals back wherever our proxy is still the binding. Returns how many.

    Scans every ``flashinfer.*`` module rather than a list of what we replaced: modules that
    ran ``from .x import f`` after we wrapped ``x`` hold the proxy too. A foreign wrapper
    stacked on top of ours is not ours, so that binding is left alone (identity check).
    """
    global _active
    restored = 0
    with _lock:
        _active = False
        for mod_name in _candidate_modules():
            module = sys.modules.get(mod_name)
            if module is None:
                continue
            for _, attr, _ in TARGETS:
                held = module.__dict__.get(attr)
                if is_ours(held):
                    setattr(module, attr, _unwrap_ours(held))
                    restored += 1
                elif held is not None and _wraps_ours(held):
                    logger.debug("%s left %s.%s alone: something else was put there after us",
                                 rank_tag(), mod_name, attr)
    return restored


def _wraps_ours(obj) -> bool:
    seen = 0
    while obj is not None and seen < 10:
        obj = getattr(obj, "__wrapped__", None)
        if is_ours(obj):
            return True
        seen += 1
    return False


def wrapped_bindings() -> list:
    """``module.attr`` names that currently hold our proxy."""
    out = []
    for mod_name in _candidate_modules():
        module = sys.modules.get(mod_name)
        if module is None:
            continue
        for _, attr, _ in TARGETS:
            if is_ours(module.__dict__.get(attr)):
                out.append(f"{mod_name}.{attr}")
    return out


def enable() -> None:
    """From now on the import hooks wrap FlashInfer's modules as they are imported."""
    global _active
    with _lock:
        _active = True


def is_active() -> bool:
    return _active
