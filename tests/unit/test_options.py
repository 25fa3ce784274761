"""The table of settings: each default in one place, the reference page, the coercion rule."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from celery_fair.errors import FairConfigError
from celery_fair.worker.options import DEFAULTS, OPTIONS, reference_page, unknown_settings
from celery_fair.worker.settings import FairSettings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_reference_page_is_the_table() -> None:
    text = PAGE.read_text()
    assert reference_page(text) == text, (
        "docs/configuration.md and celery_fair/worker/options.py differ: "
        "run python scripts/settings_reference.py"
    )
    listed = re.findall(r"^\| `(fair_[a-z_]+)` \|", text, flags=re.MULTILINE)
    assert sorted(listed) == sorted(o.name for o in OPTIONS)  # each once, none unknown


def test_a_changed_row_makes_the_page_differ() -> None:
    text = PAGE.read_text()
    edited = text.replace("| `fair_stall_after` | `10.0` |", "| `fair_stall_after` | `11.0` |")
    assert edited != text and reference_page(edited) == text


def test_every_setting_in_the_table_is_known_and_every_default_is_in_force() -> None:
    conf = {name: None for name in DEFAULTS}
    assert unknown_settings(conf) == []
    settings = FairSettings.from_conf({})
    assert settings == FairSettings.from_conf(conf)
    # The dataclass's own defaults are the table's (one place): the same record.
    plain = FairSettings()
    for field in dataclasses.fields(FairSettings):
        if field.name not in ("key_limits",):
            assert getattr(plain, field.name) == getattr(settings, field.name), field.name


@pytest.mark.parametrize(
    ("conf", "attribute", "expected"),
    [
        ({"fair_credit": "4"}, "credit", 4),
        ({"fair_prefetch": "8"}, "prefetch", 8),
        ({"fair_prefetch_max": " 16 "}, "prefetch_max", 16),
        ({"fair_atomic_fetch": "false"}, "atomic_fetch", False),
        ({"fair_atomic_fetch": "Yes"}, "atomic_fetch", True),
        ({"fair_default_weight": "2.5"}, "default_weight", 2.5),
        ({"fair_unknown_task_max_returns": "0"}, "unknown_task_max_returns", 0),
        ({"fair_codel_max_requeues": "5"}, "codel_max_requeues", 5),
        ({"fair_stall_after": "30"}, "stall_after", 30.0),
    ],
)
def test_strings_from_the_environment_are_read_as_the_settings_type(
    conf: dict[str, object], attribute: str, expected: object
) -> None:
    assert getattr(FairSettings.from_conf(conf), attribute) == expected


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        ({"fair_credit": "four"}, "fair_credit must be a positive integer or None, got 'four'"),
        ({"fair_credit": True}, "got True"),
        ({"fair_prefetch_max": 4.0}, "fair_prefetch_max must be a positive integer"),
        ({"fair_atomic_fetch": "maybe"}, "fair_atomic_fetch must be True or False, got 'maybe'"),
        ({"fair_atomic_fetch": 1}, "got 1"),
        ({"fair_codel_action": ""}, "fair_codel_action='': must be one of"),
        (
            {"fair_priority": "fifo"},
            "fair_priority must be one of 'strict', 'weighted'; got 'fifo'",
        ),
        ({"fair_unknown_task_max_returns": "-1"}, "must be an integer >= 0, got '-1'"),
        ({"fair_credit": "--4"}, "fair_credit must be a positive integer or None, got '--4'"),
        ({"fair_codel_max_requeues": "²"}, "fair_codel_max_requeues='²': must be an integer"),
        ({"fair_telemetry_dir": ""}, "fair_telemetry_dir must be a directory path"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_by_name(
    conf: dict[str, object], fragment: str
) -> None:
    with pytest.raises(FairConfigError) as info:
        FairSettings.from_conf(conf)
    assert fragment in str(info.value)
