"""Agreement: every rank's answer, ANDed, through the c10d store and never a collective.

``core`` decides one rank's round with no I/O; ``driver`` runs it on the store lines of
``store``; ``positions`` names the round (the call's position, the group's generation);
``vote`` is the verdict over the records; ``explain`` what an abort's register says;
``record`` the wire; ``group`` which ranks decide together; ``allgather`` the variant for
comm backends without a torch group.
"""
