"""Every RECYCLE_* variable is a settings field, read at call time, and listed by docs and --help alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from api.settings import Settings
from planner.settings import PlannerSettings, environment_markdown, environment_rows, planner_settings
from recycle_cli import build_parser
from runtime_adapter.settings import RuntimeSettings, runtime_settings

ROOT = Path(__file__).resolve().parents[1]
CLASSES = (PlannerSettings, RuntimeSettings, Settings)
SETTINGS_MODULES = {"planner/settings.py", "runtime_adapter/settings.py", "api/settings.py"}


def test_docs_table_is_rendered_from_the_settings_classes() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for cls in CLASSES:
        assert environment_markdown(cls) in doc, f"docs/configuration.md is stale for {cls.__name__}"
    documented = set(re.findall(r"`(RECYCLE_[A-Z0-9_]+)`", doc))
    assert documented == {var for var, _, _ in environment_rows(*CLASSES)}


def test_no_module_reads_a_recycle_variable_outside_the_settings_modules() -> None:
    offenders = []
    for package in ("planner", "runtime_adapter", "api", "whatif"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in SETTINGS_MODULES:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(environ\.get\(|environ\[|getenv\()\s*[\"']RECYCLE_", line):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "read RECYCLE_* through a settings class:\n" + "\n".join(offenders)


def test_settings_are_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECYCLE_CPSAT_MAX_OPS", "17")
    monkeypatch.setenv("RECYCLE_GROUP_TIMEOUT_S", "2.5")
    assert planner_settings().cpsat_max_ops == 17
    assert runtime_settings().group_timeout.total_seconds() == 2.5


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECYCLE_POLL_WAIT_S", "soon")
    with pytest.raises(ValueError, match="poll_wait_s"):
        runtime_settings()


def test_top_level_help_lists_every_variable() -> None:
    text = build_parser().format_help()
    for var, _, _ in environment_rows(*CLASSES):
        assert var in text, f"recycle --help does not list {var}"
