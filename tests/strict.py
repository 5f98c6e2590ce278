"""Strict mode for tests: an "internal error" in our code fails the test.

In production any exception in our own code becomes a veto (fail-closed), so a test that only
checks for a veto cannot tell a bug from a "no". Here every ``_log.internal_error`` is seen:

- in the pytest process, ``tests/conftest.py`` records each call (autouse fixture) and fails
  the test at teardown unless it is marked ``@pytest.mark.internal_errors("site", ...)``, which
  also asserts that each named site did report;
- in child processes (ranks, engines, GPU-check ranks), ``install()`` (a logging filter on our
  logger; it adds no handler, so the shim's logging stays as it is) records the site of each
  internal-error record and prints ``MARK site`` on stderr; the parents fail on an unexpected
  one (``harness.run_ranks(..., internal_errors=(...))`` names the expected sites).

``FIWS_TEST_STRICT`` (read only here) turns the child side off with ``0``; it is on by default.
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "FIWS_TEST_STRICT"
MARK = "FIWS_TEST_INTERNAL_ERROR "

seen: list = []  # sites reported in this process


class _Recorder(logging.Filter):
    def filter(self, record):
        site = getattr(record, "fiws_internal_error", None)
        if site is not None:
            seen.append(site)
            try:
                sys.stderr.write(f"{MARK}{site}: {record.getMessage()}\n")
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - a closed stderr must not change the run
                pass
        return True


_installed = None


def install() -> None:
    """Record every internal error of this process (idempotent; no import of the package)."""
    global _installed
    if _installed is not None or os.environ.get(ENV, "1") == "0":
        return
    _installed = _Recorder()
    logging.getLogger("flashinfer_safe_workspace").addFilter(_installed)


def sites_in(text: str) -> list:
    """The sites a child reported on ``text`` (its stderr)."""
    return [line[len(MARK):].split(":", 1)[0] for line in text.splitlines() if line.startswith(MARK)]


def check(sites, expected=(), where="") -> None:
    """Fail when ``sites`` has one not in ``expected``; ``expected=None`` allows any."""
    if expected is None:
        return
    bad = [s for s in sites if s not in expected]
    assert not bad, (f"internal error in our code{(' (' + where + ')') if where else ''}: "
                     f"{bad}; a test that injects one names its site (strict mode, tests/strict.py)")
