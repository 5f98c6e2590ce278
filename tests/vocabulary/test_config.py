"""The env-var grammar, precedence, warnings, and the docs' table (docs/settings.md) against the code's."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from flashinfer_safe_workspace import _config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("raw,expected,warns", [
    ("1", True, False), ("true", True, False), ("TRUE", True, False), (" yes ", True, False),
    ("on", True, False), ("On", True, False),
    ("0", False, False), ("false", False, False), ("No", False, False), ("off", False, False),
    ("", False, False), ("   ", False, False),  # empty means unset
    ("maybe", False, True), ("2", False, True), ("enable", False, True), ("-1", False, True),
])
def test_boolean_grammar(raw, expected, warns, caplog):
    caplog.set_level(logging.WARNING, logger="flashinfer_safe_workspace")
    _config._warned.clear()
    settings = _config.read_settings({"FLASHINFER_SAFE_WORKSPACE": raw})
    assert settings.enabled is expected
    assert bool(caplog.records) is warns
    if warns:
        assert "FLASHINFER_SAFE_WORKSPACE" in caplog.text and "default" in caplog.text


@pytest.mark.parametrize("name,raw,field,expected", [
    ("HEADROOM_MB", "256", "headroom_mb", 256),
    ("HEADROOM_MB", "0", "headroom_mb", 0),
    ("HEADROOM_MB", "-5", "headroom_mb", "auto"),
    ("HEADROOM_MB", "1.5", "headroom_mb", "auto"),
    ("HEADROOM_MB", "AUTO", "headroom_mb", "auto"),
    ("HEADROOM_MB", "2000000", "headroom_mb", "auto"),  # over 1 TiB: out of range
    ("VOTE_TIMEOUT", "1e14", "vote_timeout", 120.0),  # over a day: out of range
    ("VOTE_TIMEOUT", "86400", "vote_timeout", 86400.0),
    ("CREATE_TIMEOUT", "100000", "create_timeout", 0.0),
    ("VOTE_TIMEOUT", "2.5", "vote_timeout", 2.5),
    ("VOTE_TIMEOUT", "abc", "vote_timeout", 120.0),
    ("VOTE_TIMEOUT", "0", "vote_timeout", 120.0),
    ("VOTE_TIMEOUT", "inf", "vote_timeout", 120.0),
    ("VOTE_TIMEOUT", "nan", "vote_timeout", 120.0),
    ("ON_VETO", "RAISE", "on_veto", "raise"),
    ("ON_VETO", "explode", "on_veto", "auto"),
    ("ON_VETO", "None", "on_veto", "none"),
    ("UNKNOWN_VERSION", "pass-through", "unknown_version", "pass-through"),
    ("UNKNOWN_VERSION", "yolo", "unknown_version", "newest"),
    ("CREATE_TIMEOUT", "30", "create_timeout", 30.0),
    ("CREATE_TIMEOUT", "-1", "create_timeout", 0.0),
    ("ON_HANG", "abort", "on_hang", "abort"),
    ("ON_HANG", "panic", "on_hang", "log"),
    ("FAIL_OPEN", "yes", "fail_open", True),
    ("DEBUG", "sure", "debug", False),
])
def test_typed_values(name, raw, field, expected):
    _config._warned.clear()
    settings = _config.read_settings({f"FLASHINFER_SAFE_WORKSPACE_{name}": raw})
    assert getattr(settings, field) == expected


@pytest.mark.parametrize("name,raw,field", [
    ("VOTE_TIMEOUT", "1_000", "vote_timeout"), ("HEADROOM_MB", "1_0", "headroom_mb"),
    ("CREATE_TIMEOUT", "3_0.5", "create_timeout"), ("VOTE_TIMEOUT", "\u0662", "vote_timeout"),
])
def test_numbers_take_the_digits_0_to_9_only(name, raw, field, caplog):
    """Review of issue 30, W6: ``VOTE_TIMEOUT=1_000`` gave 1000.0 and ``HEADROOM_MB=1_0``
    gave 10 without a word (int() and float() read underscores), while docs/cli.md says
    digits only. A broken value gets one warning and the default."""
    caplog.set_level(logging.WARNING, logger="flashinfer_safe_workspace")
    _config._warned.clear()
    var = f"FLASHINFER_SAFE_WORKSPACE_{name}"
    for _ in range(2):
        settings = _config.read_settings({var: raw})
    assert getattr(settings, field) == _config.BY_NAME[var].default
    assert [r.getMessage() for r in caplog.records] == [
        f"flashinfer_safe_workspace: ignoring {var}={raw!r} (expected a "
        f"{'whole number' if name == 'HEADROOM_MB' else 'number'} in the digits 0-9); using "
        f"the default {_config.BY_NAME[var].default!r}"]


def test_bad_value_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="flashinfer_safe_workspace")
    _config._warned.clear()
    env = {"FLASHINFER_SAFE_WORKSPACE_ON_VETO": "explode"}
    for _ in range(3):
        _config.read_settings(env)
    assert len(caplog.records) == 1


def test_overrides_win_and_are_validated():
    settings = _config.read_settings({"FLASHINFER_SAFE_WORKSPACE_ON_VETO": "none"}, on_veto="raise")
    assert settings.on_veto == "raise"
    with pytest.raises(ValueError):
        _config.read_settings({}, on_veto="explode")
    with pytest.raises(TypeError):
        _config.read_settings({}, no_such_setting=1)


def test_settings_are_built_from_the_table():
    """One source: every field and default of Settings comes from VARIABLES."""
    import dataclasses

    fields = {f.name: f.default for f in dataclasses.fields(_config.Settings)}
    assert fields == {var.field: var.default for var in _config.VARIABLES}
    assert _config.Settings(headroom_mb=256).headroom_bytes == 256 << 20
    assert _config.Settings().headroom_bytes is None  # auto: resolved per call


def test_unknown_variable_warns_once_with_the_closest_name(caplog):
    caplog.set_level(logging.WARNING, logger="flashinfer_safe_workspace")
    _config._warned.clear()
    env = {"FLASHINFER_SAFE_WORKSPACE_ON_VET0": "raise", "FLASHINFER_SAFE_WORKSPACE_ZZZ": "1"}
    for _ in range(3):
        settings = _config.read_settings(env)
    assert settings.on_veto == "auto"  # the typo is not read as ON_VETO
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == 2, texts
    assert any("ON_VET0" in m and "did you mean FLASHINFER_SAFE_WORKSPACE_ON_VETO" in m for m in texts)
    assert any("_ZZZ" in m and "did you mean" not in m for m in texts)


def test_only_config_reads_the_environment():
    src = ROOT / "flashinfer_safe_workspace"
    allowed = {"_config.py", "activation/gate.py",  # the table, and the stdlib pre-gate (its docstring)
               "cli/demo.py"}  # the demo builds its children's environment
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if str(p.relative_to(src)) not in allowed
                 and re.search(r"os\.environ|getenv", p.read_text())]
    assert offenders == []
    assert (src / "cli" / "demo.py").exists() and (src / "planning" / "rules").is_dir()  # the walk reached them


def _readme_rows():
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        m = re.match(r"^`(FLASHINFER_SAFE_WORKSPACE[A-Z_]*)`$", cells[0]) if cells else None
        if m and len(cells) >= 3:
            rows[m.group(1)] = (cells[1], cells[2].strip("`"))
    return rows


def test_readme_env_table_matches_code():
    rows = _readme_rows()
    assert set(rows) == {v.name for v in _config.VARIABLES}
    for var in _config.VARIABLES:
        kind, default = rows[var.name]
        assert kind == var.kind, var.name
        shown = {True: "on", False: "off"}.get(var.default, var.default) \
            if isinstance(var.default, bool) else var.default
        assert default == str(shown), var.name
