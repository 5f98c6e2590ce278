"""Mode 6: ranks on several hosts over a transport that works on one host only.

CUDA IPC, POSIX file descriptors and torch's IPC channel are single-host; only FABRIC
handles inside one NVLink domain (every rank the same non-zero cluster UUID) reach
across hosts. 0.7.4's own handle vote raises on every rank before allocating, so its
allocator B4 is left to it."""

from __future__ import annotations

from .. import _reasons as R
from .base import Failure, applying, by_field, fields, group_by, handle_of, ok

NAME = "hosts"
CODE = R.HOSTS_SPAN
MODES = (6,)
RELEASES = "every release and path except 0.7.4's B4 (it votes and raises itself)"


def applies(ctx) -> bool:
    return ctx.members.size > 1 and ctx.allocator not in ("", "B4")


def local(ctx):
    f = ctx.facts()
    cluster = f.fabric.cluster_uuid if f.fabric is not None and f.fabric.has_cluster else "-"
    return ok(f"host={f.host} handle={handle_of(ctx)} cluster={cluster}")


def compare(records):
    pairs = applying(records, NAME)
    hosts = group_by(pairs, by_field("host"))
    if len(hosts) <= 1:
        return None
    facts = [fields(r.value) for _, r in pairs]
    clusters = {f.get("cluster") for f in facts}
    if all(f.get("handle") == "fabric" for f in facts) and len(clusters) == 1 \
            and "-" not in clusters:
        return None  # one NVLink domain with FABRIC handles
    return Failure(NAME, R.HOSTS_SPAN, f"the ranks span {len(hosts)} hosts but the transport "
                   "is single-host (no FABRIC handles in one NVLink domain)", hosts)
