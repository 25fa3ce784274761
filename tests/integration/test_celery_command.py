"""``celery fair``: the tools as a ``celery`` subcommand, and their errors, run as a user
runs them (the ``celery`` program in a subprocess, a project module, a real Redis)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_fair.cli import BAD_INPUT, BROKER_AWAY
from tests.harness.keys import keyed_app, publish_by_key

pytestmark = [pytest.mark.integration]

SUBCOMMANDS = ("ring", "capture", "report", "parked", "keys", "exporter", "check")


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def project(tmp_path: Path, redis_url: str) -> Path:
    (tmp_path / "proj.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            import celery_fair

            app = Celery("proj", broker={redis_url!r})
            app.conf.fair_keys = {{"jobs": "tenant_id"}}
            app.conf.task_routes = (
                celery_fair.ConsistentHashRouter({{"p0": 1, "p1": 3}}, key="tenant_id"),
            )
            celery_fair.install(app)
            """
        )
    )
    return tmp_path


def run(cwd: Path, *argv: str, program: str = "celery") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "celery"] if program == "celery" else [
        sys.executable, "-m", "celery_fair.cli",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [*command, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The error a command printed: one line, no traceback (argparse's usage lines aside)."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line and not line.startswith(" ")]
    lines = [line for line in lines if not line.startswith("usage:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_celery_fair_is_a_celery_subcommand_with_the_apps_broker(
    project: Path, redis_url: str
) -> None:
    top = run(project, "-A", "proj", "fair", "--help")
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: celery fair")
    assert all(name in top.stdout for name in SUBCOMMANDS), top.stdout
    assert "Exit status" in top.stdout
    for name in SUBCOMMANDS:
        each = run(project, "-A", "proj", "fair", name, "--help")
        assert each.returncode == 0 and each.stdout.startswith(f"usage: celery fair {name}"), (
            name, each.stdout, each.stderr,
        )  # fmt: skip
    app = keyed_app(redis_url, {"jobs": "tenant_id"})
    try:
        publish_by_key(app, "jobs", {"a": 3, "b": 2}, ms=1)
    finally:
        app.close()
    # -A at Celery's level: the subcommand reads the app's broker.
    backlog = run(project, "-A", "proj", "fair", "keys", "backlog", "jobs")
    assert backlog.returncode == 0, backlog.stderr
    assert backlog.stdout.splitlines()[0] == "jobs: 5 message(s) in 2 key(s)", backlog.stdout
    as_json = run(project, "-A", "proj", "fair", "keys", "backlog", "jobs", "--json")
    assert as_json.returncode == 0, as_json.stderr
    found = json.loads(as_json.stdout)
    assert (found["messages"], found["keys"]) == (5, 2), found
    assert sorted(k["key"] for k in found["next_keys"]) == ["a", "b"], found
    paused = run(project, "-A", "proj", "fair", "keys", "pause", "jobs", "a", "--json")
    assert json.loads(paused.stdout) == {"queue": "jobs", "paused": 1, "of": 1}, paused
    # ... and its routes.
    ring = run(project, "-A", "proj", "fair", "ring", "--keys", "1000", "--json")
    assert ring.returncode == 0, ring.stderr
    assert '"p1"' in ring.stdout
    checked = run(project, "-A", "proj", "fair", "check")
    assert checked.returncode == 0 and "fair_keys" in checked.stdout, checked.stderr
    version = run(project, "fair", "--version")
    assert version.returncode == 0 and version.stdout.startswith("celery-fair ")


def test_bad_input_is_one_line_with_its_exit_status(project: Path) -> None:
    away = f"redis://127.0.0.1:{unused_port()}/0"
    cases = [
        # The broker cannot be reached.
        (("-b", away, "fair", "keys", "backlog", "jobs"), BROKER_AWAY, "cannot reach the broker"),
        # Checked before any connection: the broker is away, yet the answer is bad input.
        (("-b", away, "fair", "keys", "pause", "jobs"), BAD_INPUT, "name the keys"),
        (("fair", "ring", "--queues", "p0=1e308,p1=1e308"), BAD_INPUT, "too large"),
        (("fair", "ring", "--queues", "p0=abc"), BAD_INPUT, "positive number, not 'abc'"),
        # An abbreviation is refused, not guessed (--see for --seed).
        (("fair", "ring", "--queues", "p0=1", "--see", "3"), BAD_INPUT, "unrecognized arguments"),
    ]
    for argv, status, said in cases:
        done = run(project, *argv)
        assert done.returncode == status, (argv, done.returncode, done.stderr)
        assert said in one_line_error(done), (argv, done.stderr)
    # The program of its own: an app that cannot be loaded.
    done = run(project, "keys", "backlog", "jobs", "-A", "nosuchmod", program="celery-fair")
    assert done.returncode == BAD_INPUT, done.stderr
    assert "cannot load the Celery app" in one_line_error(done)
