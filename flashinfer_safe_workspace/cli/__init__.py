"""The command line: ``python -m flashinfer_safe_workspace`` and the console script.

    main     the parser and the dispatch
    plan     what a FlashInfer release allocates for given arguments (no GPU needed)
    check    does a workspace fit on this GPU now (exit 0 / 1 / 2)
    doctor   is the shim active here, and why; the runtime facts it plans with
    demo     local ranks creating a workspace through the shim
"""

from .main import main

__all__ = ["main"]
