import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _clean_shim(monkeypatch):
    """Every test starts and ends with the shim uninstalled and default settings."""
    for name in list(os.environ):
        if name.startswith("FLASHINFER_SAFE_WORKSPACE"):
            monkeypatch.delenv(name)
    yield
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace import _config
    from flashinfer_safe_workspace.planning import probe as _probe

    fiws.uninstall()
    _probe.set_prober(None)
    _config.reload()
