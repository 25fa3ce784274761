"""The package root: what a Celery user imports, and what their type checker sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import tomllib

import celery_fair


def test_every_public_name_resolves_and_internals_are_not_at_the_root() -> None:
    for name in celery_fair.__all__:
        assert getattr(celery_fair, name) is not None, name
    assert {"install", "ConsistentHashRouter", "IsolationPolicy", "FairConsumerMixin"} <= set(
        celery_fair.__all__
    )
    for internal in ("FairScheduler", "DeficitRoundRobin"):
        with pytest.raises(AttributeError, match=internal):
            getattr(celery_fair, internal)
    # Still importable from their modules.
    from celery_fair.scheduling.scheduler import FairScheduler

    assert FairScheduler.__module__ == "celery_fair.scheduling.scheduler"


def test_the_package_is_typed_for_its_users(tmp_path: Path) -> None:
    root = Path(celery_fair.__file__).parent
    assert resources.files("celery_fair").joinpath("py.typed").is_file()
    project = tomllib.loads((root.parent / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["celery_fair"]
    # The package as a user's environment has it (on the path, not as this
    # project's sources), and a user's module that misuses it.
    site = tmp_path / "site"
    shutil.copytree(root, site / "celery_fair", ignore=shutil.ignore_patterns("__pycache__"))
    user = tmp_path / "proj.py"
    user.write_text(
        "from celery import Celery\n"
        "import celery_fair\n"
        "app: Celery = celery_fair.install(Celery('proj'))\n"
        "celery_fair.install()\n"
    )
    found = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports", str(user)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "PYTHONPATH": str(site)},
    )  # fmt: skip
    # The mistake is seen (without py.typed the module would be Any, and pass).
    assert found.returncode == 1, found.stdout + found.stderr
    assert 'proj.py:4: error: Missing positional argument "app"' in found.stdout, found.stdout
    assert "proj.py:3" not in found.stdout, found.stdout
