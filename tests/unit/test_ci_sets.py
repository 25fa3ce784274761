"""CI's choice of version sets (``nox -s ci``): the newest set runs unless ``make test``
already ran the same Celery line at versions at least the set's pins."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("nox")

NOXFILE = Path(__file__).resolve().parents[2] / "noxfile.py"


@pytest.fixture(scope="module")
def noxfile() -> ModuleType:
    """The noxfile, loaded once: loading registers its sessions with nox."""
    spec = importlib.util.spec_from_file_location("celery_fair_noxfile", NOXFILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("venv", "covered"),
    [
        (("5.7.0", "5.7.0", "8.1.0"), True),  # the pins themselves
        (("5.7.0", "5.7.0", "8.2.0"), True),  # a redis-py released after the pins
        (("5.7.1", "5.7.2", "8.10.0"), True),  # 8.10 is newer than 8.1
        (("5.7.0", "5.7.0", "8.0.1"), False),  # older than a pin
        (("5.6.3", "5.6.2", "6.4.0"), False),  # another Celery line
        (("5.7.0", "5.7.0", "8.2.0rc1"), False),  # a pre-release is not taken for a release
        (("5.7.0", "5.7.0"), False),  # unreadable
    ],
)
def test_the_newest_set_is_skipped_only_when_the_venv_covers_it(
    noxfile: ModuleType, venv: tuple[str, ...], covered: bool
) -> None:
    assert noxfile._covers(venv, ("5.7.0", "5.7.0", "8.1.0")) is covered
