"""The decision log line's parser: ``DECISION_LINE`` and ``parse_decision_lines``.

The line itself is written by ``_decide``; its parser belongs beside it in ``_log``.
Until the lead's ``_log`` carries it, the command line imports it from there when it
can and from this module otherwise (``from_log()``).
"""

from __future__ import annotations

import re

# The INFO line every fresh decision logs (``_decide._log_decision``); a cached veto
# logs none. Any prefix a handler's format adds is allowed before ``fiws decision``.
DECISION_LINE = re.compile(
    r"fiws decision rank=(?P<rank>-|\d+) pid=(?P<pid>\d+) outcome=(?P<outcome>pass|veto)"
    r" entry=(?P<entry>unified|legacy) backend=(?P<backend>[a-z-]+)"
    r" ranks=(?P<ranks>\d+(?:,\d+)*) device=(?P<device>cuda:\d+|-)"
    r" plan_bytes=(?P<plan_bytes>-?\d+)"
    r" free_bytes=(?P<free_bytes>-?\d+) probe=(?P<probe>ok|no)"
    r" elapsed_ms=(?P<elapsed_ms>\d+\.\d+)$")


def parse_decision_lines(text: str) -> list:
    """Every decision line in ``text`` as a dict with typed values."""
    out = []
    for line in text.splitlines():
        match = DECISION_LINE.search(line.rstrip())
        if match is None:
            continue
        d = match.groupdict()
        d["rank"] = None if d["rank"] == "-" else int(d["rank"])
        d["ranks"] = [int(x) for x in d["ranks"].split(",")]
        for key in ("pid", "plan_bytes", "free_bytes"):
            d[key] = int(d[key])
        d["elapsed_ms"] = float(d["elapsed_ms"])
        out.append(d)
    return out



def from_log():
    """(DECISION_LINE, parse_decision_lines): ``_log``'s where it has them, else ours."""
    from .. import _log

    regex = getattr(_log, "DECISION_LINE", None)
    parse = getattr(_log, "parse_decision_lines", None)
    if regex is not None and parse is not None:
        return regex, parse
    return DECISION_LINE, parse_decision_lines
