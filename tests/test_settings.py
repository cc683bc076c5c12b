"""Every JAXDDP_* setting: one parsing rule, one error, one table in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxddp._base import settings as _settings
from jaxddp._base.settings import SettingError, SkipLevel

DOCS = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
PACKAGE = Path(__file__).resolve().parents[1] / "jaxddp"


@pytest.mark.parametrize("value", ["1", "true", "YES", "On", " yes "])
def test_every_boolean_takes_the_same_words_for_on(value):
    assert _settings.check_trees({"JAXDDP_CHECK": value}) is True
    assert _settings.abort_on_error({"JAXDDP_ABORT_ON_ERROR": value}) is True
    assert _settings.skip_launcher_check({"JAXDDP_SKIP_LAUNCHER_CHECK": value}) is SkipLevel.INIT


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_every_boolean_takes_the_same_words_for_off(value):
    assert _settings.check_trees({"JAXDDP_CHECK": value}) is False
    assert _settings.abort_on_error({"JAXDDP_ABORT_ON_ERROR": value}) is False
    assert _settings.skip_launcher_check({"JAXDDP_SKIP_LAUNCHER_CHECK": value}) is SkipLevel.NONE


def test_unset_or_empty_means_the_default():
    for env in ({}, {name.name: "" for name in _settings.SETTINGS}):
        assert _settings.check_trees(env) is True
        assert _settings.abort_on_error(env) is True
        assert _settings.skip_launcher_check(env) is SkipLevel.NONE
        assert _settings.check_timeout(env) == 60.0
    assert _settings.skip_launcher_check({"JAXDDP_SKIP_LAUNCHER_CHECK": "ALL"}) is SkipLevel.ALL


@pytest.mark.parametrize(
    ("name", "read", "value"),
    [
        ("JAXDDP_CHECK", _settings.check_trees, "2"),
        ("JAXDDP_ABORT_ON_ERROR", _settings.abort_on_error, "nope"),
        ("JAXDDP_SKIP_LAUNCHER_CHECK", _settings.skip_launcher_check, "maybe"),
        ("JAXDDP_CHECK_TIMEOUT", _settings.check_timeout, "-1"),
        ("JAXDDP_CHECK_TIMEOUT", _settings.check_timeout, "nan"),
        ("JAXDDP_CHECK_TIMEOUT", _settings.check_timeout, "ten"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_the_choices(name, read, value):
    with pytest.raises(SettingError) as info:
        read({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} is not a value jaxddp understands: expected ")
    assert "unset or empty for the default" in message
    assert isinstance(info.value, ValueError)


def test_the_timeout_takes_numbers():
    assert _settings.check_timeout({"JAXDDP_CHECK_TIMEOUT": "0.5"}) == 0.5
    assert _settings.check_timeout({"JAXDDP_CHECK_TIMEOUT": "inf"}) == float("inf")


def test_the_docs_table_lists_every_setting_as_the_module_does():
    text = DOCS.read_text()
    rows = {
        m.group(1): m.group(0) for m in re.finditer(r"^\| `(JAXDDP_\w+)` \|.*$", text, re.MULTILINE)
    }
    assert set(rows) == {s.name for s in _settings.SETTINGS}
    for setting in _settings.SETTINGS:
        assert rows[setting.name] == (
            f"| `{setting.name}` | {setting.accepts} | {setting.default} | {setting.effect} |"
        )


def test_no_module_reads_a_jaxddp_variable_but_the_settings():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_settings.py":
            continue
        text = path.read_text()
        assert not re.search(r"environ(\.get)?\(?\[?[\"']JAXDDP_", text), path
