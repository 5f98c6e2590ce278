"""The decision line's parser for the command line: the one in ``_log``, beside the writer."""

from __future__ import annotations

from .._log import DECISION_FIELDS, DECISION_LINE, parse_decision_lines  # noqa: F401


def from_log():
    """(DECISION_LINE, parse_decision_lines)."""
    return DECISION_LINE, parse_decision_lines
