"""The pre-gate: the master switch's raw value, read with the stdlib alone.

The ``.pth`` line makes the same check before importing anything of ours. This module is
the one place besides ``_config`` that reads the environment: importing ``_config``
(dataclasses, logging, …) costs milliseconds that a process which never imports FlashInfer
should not pay. A value outside the four "on" spellings goes to ``_config``'s full parser,
which warns about it.
"""

import os

VARIABLE = "FLASHINFER_SAFE_WORKSPACE"
_ON = frozenset({"1", "true", "yes", "on"})


def plainly_on() -> bool:
    """The master switch holds one of the valid "on" spellings."""
    return os.environ.get(VARIABLE, "").strip().lower() in _ON
