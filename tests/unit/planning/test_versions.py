"""``planning/rules/versions.py`` on its own: how a version string is read (PEP 440
spellings, a loose prefix), which releases are unknown and why, and the one lookup of
the FlashInfer version this process plans for."""

from __future__ import annotations

import sys
import types

import pytest

from flashinfer_safe_workspace.planning import rules as R
from flashinfer_safe_workspace.planning.plan import Unplanned
from flashinfer_safe_workspace.planning.rules import versions

CANONICAL = [  # text -> the release as the READ table spells it (None: no release)
    ("0.7.4", "0.7.4"), ("v0.7", "0.7.0"), ("0.7.4.0", "0.7.4"), ("0.0", "0.0.0"),
    ("0.0.0", "0.0.0"), ("0.7.2post1", "0.7.2.post1"), ("0.7.2-1", "0.7.2.post1"),
    ("0.7.2.post", "0.7.2.post0"),  # PEP 440: an empty post number is 0
    ("0.7.4rc1", None), ("0.7.4.dev3", None), ("0.7.4+cu128", None), ("nightly", None),
]


@pytest.mark.parametrize("text,expected", CANONICAL)
def test_canonical(text, expected):
    assert versions.canonical(text) == expected


PARSED = [  # the strict PEP 440 reading, then the loose prefix for anything else
    ("0.6", (0, 6, 0, 0)), ("0.7.2-3", (0, 7, 2, 3)), ("0.7.4rc1", (0, 7, 4, 0)),
    ("0.7.4 (built from git)", (0, 7, 4, 0)), ("v1.2 x", (1, 2, 0, 0)),
    ("0.7.2post3 custom", (0, 7, 2, 3)), ("0.6.10.post1 !", (0, 6, 10, 1)),
]


@pytest.mark.parametrize("text,expected", PARSED)
def test_parse_version(text, expected):
    assert versions.parse_version(text) == expected


def test_text_that_is_no_version_is_unplanned():
    with pytest.raises(Unplanned, match=r"^cannot parse FlashInfer version 'garbage'$"):
        versions.parse_version("garbage")


UNKNOWN = [  # version -> is_unknown, unverified_why (when unknown)
    ("0.4.9", False, None),  # older than every rule: Unplanned, not unknown
    ("0.5.0", False, None),
    ("0.5.0rc1", True, "a pre-release, development or local build, not a release whose "
                       "source was read"),
    ("0.5.4", True, "a release whose source was not read"),
    ("0.6.16.post5", True, "a release whose source was not read"),
    ("0.7.4.post1", True, "a release whose source was not read"),
    ("0.7.5", True, "newer than the newest release mirrored (0.7.4)"),
    ("1.0", True, "newer than the newest release mirrored (0.7.4)"),
]


@pytest.mark.parametrize("version,unknown,why", UNKNOWN)
def test_unknown_releases_and_why(version, unknown, why):
    assert R.is_unknown(version) is unknown
    if why is not None:
        assert R.unverified_why(version) == why


# ---------------------------------------------------------------- flashinfer_version()
def _metadata(monkeypatch, answer):
    import importlib.metadata as md

    def version(name):
        assert name == "flashinfer-python"
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(md, "version", version)


def test_the_imported_module_s_version_first(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.9"))
    _metadata(monkeypatch, "0.7.4")
    assert R.flashinfer_version() == "0.6.9"


def test_the_installed_distribution_when_not_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    _metadata(monkeypatch, "0.7.2.post1")
    assert R.flashinfer_version() == "0.7.2.post1"
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())  # no __version__
    assert R.flashinfer_version() == "0.7.2.post1"


def test_a_version_object_is_given_as_text(monkeypatch):
    class Version:
        def __str__(self):
            return "0.7.1"

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__=Version()))
    assert R.flashinfer_version() == "0.7.1"


@pytest.mark.parametrize("error", [None, RuntimeError("broken metadata")])
def test_not_installed_or_broken_metadata_is_none(monkeypatch, error):
    import importlib.metadata as md

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    _metadata(monkeypatch, md.PackageNotFoundError("flashinfer-python") if error is None
              else error)
    assert R.flashinfer_version() is None
