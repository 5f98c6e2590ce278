"""The one exception of ours that may reach the host engine."""

from __future__ import annotations


class WorkspaceVetoed(RuntimeError):
    """Raised on every rank when the group-wide vote refuses to create the workspace.

    A ``RuntimeError`` so that engines' ``except Exception`` fallbacks take their
    non-fused path. ``details`` holds one entry per rank that said no; ``reasons`` the
    reason codes (``_reasons``) of the veto.
    """

    def __init__(self, message: str, *, ranks=(), details=(), reasons=()):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.details = tuple(details)
        self.reasons = tuple(reasons)
