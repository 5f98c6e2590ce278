"""The master switch, read with the stdlib alone, and the callables every activation path
calls.

The paths: the ``.pth`` line (Python up to 3.17), the ``.start`` file (PEP 829, Python
3.15 and later, where it replaces the ``.pth`` line), the engines' plugin entry points
(``vllm.general_plugins``, ``sglang.srt.plugins``, ``aphrodite.general_plugins``) and the
``sitecustomize`` example. Each calls one function below; the variable is the one switch
for all of them: unset, empty or off, the call returns having imported nothing else. Any
other value goes to the bootstrap, which defers everything heavy until ``flashinfer`` is
imported (and, for a value outside the spellings below, lets ``_config`` warn about it).

Importing the package does not activate anything: the CLI and ``install()`` import it too.

This module is the one place besides ``_config`` that reads the environment: importing
``_config`` (dataclasses, logging, …) costs milliseconds that a process which never imports
FlashInfer should not pay. The variable's name and its boolean spellings live in
``_switch`` (beneath both), which ``_config`` reads too.
"""

import os

from .._switch import OFF, ON, VARIABLE


def _raw() -> str:
    return os.environ.get(VARIABLE, "").strip().lower()


def plainly_on() -> bool:
    """The master switch holds one of the valid "on" spellings."""
    return _raw() in ON


def switched_off() -> bool:
    """The master switch is unset, empty, or one of the "off" spellings."""
    value = _raw()
    return value == "" or value in OFF


def activate(path: str) -> None:
    """Hand over to the bootstrap (once per process, whichever path comes first) unless the
    switch is off. Never raises: interpreter start-up and the engines' plugin loaders must
    not depend on us."""
    if switched_off():
        return
    try:
        from .bootstrap import main

        main(path, plainly_on())
    except Exception:  # noqa: BLE001 - the bootstrap reports its own failures
        pass


def from_pth() -> None:
    """The ``.pth`` line's call."""
    activate("pth")


def from_start_file() -> None:
    """The ``flashinfer_safe_workspace.start`` entry point (PEP 829)."""
    activate("start")


def from_sitecustomize() -> None:
    """``sitecustomize_example/``'s call."""
    activate("sitecustomize")


def vllm_plugin() -> None:
    """``vllm.general_plugins`` entry point (every vLLM process; ``VLLM_PLUGINS`` filters)."""
    activate("plugin:vllm")


def sglang_plugin() -> None:
    """``sglang.srt.plugins`` entry point (SGLang 0.5.11 and later; ``SGLANG_PLUGINS``
    filters)."""
    activate("plugin:sglang")


def aphrodite_plugin() -> None:
    """``aphrodite.general_plugins`` entry point (``APHRODITE_PLUGINS`` filters)."""
    activate("plugin:aphrodite")
