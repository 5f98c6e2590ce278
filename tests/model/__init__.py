"""A model of the agreement for checking it: the c10d store's semantics, ranks running the
package's own sans-IO core (``flashinfer_safe_workspace.agreement.core``), time, and faults.

``system`` is the model (states and their successors), ``checker`` explores every
interleaving of a small one breadth-first, ``simulate`` runs long seeded histories of large
ones. Both drive the very same ``Core`` the production driver runs.
"""
