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

#: A default each subcommand's --help shows (where it has one worth showing).
DEFAULTS_SHOWN = {
    "ring": "number of keys (default: 100000)",
    "capture": "(default: the app's fair_cost, count when unset)",
    "report": "output directory (local) (default: fair-report)",
    "parked": "at most this many (oldest first)",  # no default: all of them
    "keys": "next keys shown (backlog) (default: 10)",
    "exporter": "largest keys per keyed queue (default: 10)",
    "check": "list the settings left at their defaults too",  # a flag: nothing to show
}


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
    # An app whose settings a worker would refuse, and a telemetry directory with nothing in it.
    (tmp_path / "badcost.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('badcost', broker={redis_url!r})\n"
        "app.conf.fair_cost = 'bogus'\n"
    )
    (tmp_path / "empty").mkdir()
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
        # The defaults are shown (argparse's help wraps lines: compare the words).
        words = " ".join(each.stdout.split())
        assert DEFAULTS_SHOWN[name] in words, (name, each.stdout)
        assert "(default: None)" not in words and "(default: False)" not in words, name
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
    # ... and its broker for capture (no --app): stdout is the one JSON object of counts.
    captured = run(project, "-A", "proj", "fair", "capture", "--out", "t", "--duration", "0.5",
                   "--json")  # fmt: skip
    assert captured.returncode == 0, captured.stderr
    assert json.loads(captured.stdout) == {
        "records": 0, "unfinished": 0, "written": 0, "dropped": 0, "files": 0,
    }  # fmt: skip
    assert "capturing task events into t" in captured.stderr
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
    for argv, said in BAD_INPUT_PER_COMMAND:
        done = run(project, *argv)
        assert done.returncode == BAD_INPUT, (argv, done.returncode, done.stderr)
        assert said in one_line_error(done), (argv, done.stderr)
    # The program of its own: an app that cannot be loaded.
    done = run(project, "keys", "backlog", "jobs", "-A", "nosuchmod", program="celery-fair")
    assert done.returncode == BAD_INPUT, done.stderr
    assert "cannot load the Celery app" in one_line_error(done)
    done = run(project, "capture", "-A", "nosuchmod", "--out", "t", program="celery-fair")
    assert done.returncode == BAD_INPUT, done.stderr
    assert "cannot load the Celery app" in one_line_error(done)


#: Bad input of each subcommand, said in one line with exit status 2 by the
#: celery program (proj: the project's app; badcost: an app with fair_cost "bogus").
BAD_INPUT_PER_COMMAND: list[tuple[tuple[str, ...], str]] = [
    (("-A", "proj", "fair", "ring", "--queus", "p0=1"),
     "unrecognized arguments: --queus (did you mean --queues?)"),
    (("-A", "proj", "fair", "capture", "--out", "t", "--queues", "p0=abc"),
     "positive number, not 'abc'"),
    (("-A", "badcost", "fair", "capture", "--out", "t"),
     "fair_cost must be one of 'count', 'runtime', 'dominant'; got 'bogus'"),
    (("fair", "capture", "-A", "nosuchmod", "--out", "t"), "cannot load the Celery app"),
    (("-A", "proj", "fair", "capture", "--out", "t", "--weights", "p0=1"),
     "unrecognized arguments: --weights"),
    (("fair", "report", "no-such-dir"), "no-such-dir: no such telemetry directory"),
    (("fair", "report", "empty"), "empty: no telemetry files in it"),
    (("fair", "report", "empty", "--noisy-in-flight", "1.5"), "--noisy-in-flight"),
    (("-A", "proj", "fair", "parked"), "the following arguments are required: QUEUE"),
    (("-A", "proj", "fair", "parked", "jobs", "--limit", "0"), "at least 1, not '0'"),
    (("-A", "proj", "fair", "keys", "backlog", "jobs", "--tops", "3"),
     "unrecognized arguments: --tops (did you mean --top?) 3"),
    (("-A", "proj", "fair", "exporter", "--top-keys", "3"),
     "unrecognized arguments: --top-keys (did you mean --top?) 3"),
    (("-A", "proj", "fair", "exporter", "--port", "abc"), "argument --port: invalid int value"),
    (("-A", "badcost", "fair", "check"), "fair_cost must be one of"),
]  # fmt: skip
