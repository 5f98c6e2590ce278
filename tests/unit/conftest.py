"""The fast layer: functions over facts and records, no processes. Every test under
``tests/unit`` carries the ``unit`` marker (``pytest -m unit`` runs only these)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.unit)
