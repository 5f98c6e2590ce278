import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    # pytest-xdist's workers (pyproject: addopts -n 2) are fresh interpreters started
    # without -P: keep the current directory off their sys.path as well, so that every
    # worker imports the installed package, as the README's command does
    if sys.flags.safe_path:
        os.environ.setdefault("PYTHONSAFEPATH", "1")
    config.addinivalue_line(
        "markers", "internal_errors(*sites): the test injects a bug at these sites of our code "
        "(strict mode: any other internal error fails it; each named site must report)")


# Files whose tests start fresh interpreters, real rank sets, builds or other Pythons: seconds
# each. They are marked ``slow``; ``pytest -m "not slow"`` is the quick subset for someone
# editing a check (README, Tests). A test elsewhere can carry the mark itself.
SLOW_FILES = {
    "test_faults.py", "test_agreement_property.py", "test_wheel.py", "test_pythons.py",
    "test_sitecustomize.py", "test_installed.py", "test_startup.py", "test_activation.py",
    "test_compat.py", "test_bench_provenance.py", "test_demo.py", "test_logs.py",
    "test_patch.py", "test_cli_inputs.py", "test_audit.py", "test_harness.py",
    "test_doctor.py", "test_check.py", "test_reinit.py", "test_bench_success_path.py",
}
SLOW_DIRS = {"engines", "gpu"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path
        if path.name in SLOW_FILES or path.parent.name in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture(autouse=True)
def _strict(request, monkeypatch):
    """Strict mode (tests/strict.py): an internal error in our code, in this process, fails
    the test unless its ``internal_errors`` mark names the site (which then must report)."""
    from flashinfer_safe_workspace import _log

    original = _log.internal_error
    seen = []

    def recording(site, exc):
        seen.append((site, f"{type(exc).__name__}: {exc}"))
        return original(site, exc)

    recording.strict_recorder = True
    for name, module in list(sys.modules.items()):
        bound = getattr(module, "internal_error", None)
        # a module first imported during an earlier test bound that test's recorder
        if (name == "flashinfer_safe_workspace" or name.startswith("flashinfer_safe_workspace.")) \
                and (bound is original or getattr(bound, "strict_recorder", False)):
            monkeypatch.setattr(module, "internal_error", recording)
    yield seen
    mark = request.node.get_closest_marker("internal_errors")
    expected = tuple(mark.args) if mark is not None else ()
    bad = [s for s in seen if s[0] not in expected]
    assert not bad, f"internal error in our code (strict mode, tests/strict.py): {bad}"
    missing = [site for site in expected if site not in {s[0] for s in seen}]
    assert not missing, f"the test expected an internal error at {missing}; none was reported"
