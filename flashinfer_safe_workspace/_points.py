"""Named fault points, for tests only: ``hit(name)`` marks a place in a decision where a
fault scenario may act (stop this process, raise, tell its test and wait to be released).

Nothing is installed in normal use, and then a point costs one global lookup and a None
check. A test installs one callable with ``install(fn)``; ``fn(name)`` is then called at
every point, in the thread that reaches it, and whatever it raises propagates from there.
This module imports nothing of ours (the bottom layer).

The points (where they sit):

- ``probe``: in the memory check, just before the probe allocates;
- ``round.published``: a yes rank has published its record and counted itself in (on the
  store line's thread, before it looks at the count);
- ``round.abort_sending``: a rank's own abort (its deadline, an interrupt) is about to be
  sent (on the store line's thread);
- ``round.before_register``: a rank's write of the register, or its read of it, has been
  answered by the store, and the answer is not handed to its decision yet;
- ``round.voted``: a rank's vote is over (its outcome known; its count-out queued).
"""

from __future__ import annotations

from typing import Callable, Optional

_hook: Optional[Callable[[str], None]] = None


def hit(name: str) -> None:
    """Call the installed hook with ``name``; nothing when none is installed."""
    if _hook is not None:
        _hook(name)


def install(fn: Optional[Callable[[str], None]]) -> None:
    """Install ``fn`` as the hook of every point (``None``: remove it)."""
    global _hook
    _hook = fn


def after(value, name: str):
    """``hit(name)``, then ``value``: a point just after an expression, on the same line."""
    hit(name)
    return value
