"""The master switch's name and its boolean spellings: the one home of both.

Read by ``activation.gate`` (the stdlib pre-gate that every activation path calls) and
by ``_config`` (the table of every variable). Standard library only, and nothing at all
imported: the gate loads it in processes that never import FlashInfer.
"""

VARIABLE = "FLASHINFER_SAFE_WORKSPACE"
ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"0", "false", "no", "off"})
