"""Strict mode itself (tests/conftest.py, ``_strict``): an internal error is seen in a module
that was first imported during an earlier test (it bound that test's recorder, not
``_log.internal_error``). The two tests run in this order (pytest's file order)."""

import sys
import types

import pytest

NAME = "flashinfer_safe_workspace._strict_selftest"


def test_a_module_is_first_imported_during_a_test():
    from flashinfer_safe_workspace import _log

    module = types.ModuleType(NAME)
    module.internal_error = _log.internal_error  # what `from ._log import internal_error` binds now
    sys.modules[NAME] = module


def test_its_internal_error_fails_a_later_test(_strict):
    if NAME not in sys.modules:
        pytest.skip("needs the test before it in the same run")
    try:
        sys.modules[NAME].internal_error("strict.selftest", ValueError("injected"))
        assert [site for site, _ in _strict] == ["strict.selftest"], _strict
        _strict.clear()  # seen: this test does not fail at teardown
    finally:
        sys.modules.pop(NAME, None)
