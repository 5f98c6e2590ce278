"""Agreement: every rank's answer, ANDed, through the c10d store and never a collective.

``group`` finds the ranks that decide together; ``vote`` is the verdict over their
records; ``round`` is one decision's keys and register in the store; ``store`` is our own
bounded line to it; ``allgather`` is the variant for comm backends without a torch group;
``explain`` turns a veto into the message every rank logs.
"""
