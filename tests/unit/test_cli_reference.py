"""docs/cli.md is what scripts/cli_reference.py makes of the commands' own parsers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from celery_fair.cli import EXIT_STATUSES, build_parser, reference_page
from celery_fair.cli_options import shown_default

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_reference_page_is_the_parsers() -> None:
    assert reference_page(prog="celery fair") == PAGE.read_text(), (
        "docs/cli.md and the commands' parsers differ: run python scripts/cli_reference.py"
    )


def test_a_changed_default_makes_the_page_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_fair.monitoring import exporter

    text = PAGE.read_text()
    assert "| `--port PORT` | `9808` |" in text
    monkeypatch.setattr(exporter, "DEFAULT_PORT", 9809)
    made = reference_page(prog="celery fair")
    assert made != text and "| `--port PORT` | `9809` |" in made


def test_every_command_option_default_and_exit_status_is_on_the_page() -> None:
    text = PAGE.read_text()
    for status, _ in EXIT_STATUSES:
        assert re.search(rf"^\| {status} \| ", text, flags=re.MULTILINE), status
    for name, sub in subcommands(build_parser(prog="celery fair")).items():
        assert f"\n## celery fair {name}\n" in text, name
        section = text.split(f"\n## celery fair {name}\n", 1)[1].split("\n## ", 1)[0]
        assert f"usage: celery fair {name} " in section, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = action.option_strings[0] if action.option_strings else action.metavar
            assert f"`{shown or ''}" in section, (name, action.dest)
            default = shown_default(action)
            if default is not None:  # the page and --help say the same default
                assert f" | `{default}` | " in section, (name, action.dest)
                assert f"(default: {default})" in " ".join(sub.format_help().split())


def test_the_page_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse wraps at $COLUMNS; the page is wrapped at its own width.
    monkeypatch.setenv("COLUMNS", "40")
    assert reference_page(prog="celery fair") == PAGE.read_text()
