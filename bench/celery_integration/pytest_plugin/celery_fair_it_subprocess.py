"""The suite's shared worker as a real ``celery worker`` subprocess with Celery's defaults.

Celery's integration suite runs its tests against ``celery_session_worker``: the
embedded test worker (``celery.contrib.testing.worker.start_worker``), a thread of
the pytest process with mingle, gossip and heartbeat switched off.  Deployments run
``celery -A proj worker``.  With ``--celery-fair-worker subprocess`` the plugin puts
:func:`subprocess_session_worker` in that fixture's place: it starts

    celery -A celery_fair_it_worker worker -n <the embedded worker's node name> -l INFO

(no ``--without-*`` flag, Celery's default pool and concurrency; ``-P`` only when the
suite's ``celery_worker_pool`` is not prefork, the default), waits until the worker
answers a ping and has run ``celery.ping`` (as ``start_worker`` does), yields a
:class:`SubprocessWorker`, and stops it with a warm shutdown (SIGTERM to its main
process, as ``celery multi stop`` does), recording the exit status.

The node name is the embedded worker's (``anon_nodename()`` of this process): the
suite's ``test_inspect.py`` expects replies from that node.  ``-l INFO`` puts what
the worker did in its log (kept by ``--keep``); it switches nothing off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ("WORKERS", "SubprocessWorker", "subprocess_session_worker")

#: The worker's app module (``celery_fair_it_worker.py`` beside this file).
APP_MODULE = "celery_fair_it_worker"
#: Seconds for the worker to answer a ping: Python start-up, mingle's wait for
#: other workers' replies, a busy shared machine.
READY_TIMEOUT = 120.0
#: Seconds the warm shutdown may take before the worker is killed.
STOP_TIMEOUT = 60.0
#: Every subprocess worker of the session, as records for the result file.
WORKERS: list[dict[str, Any]] = []


@dataclass
class SubprocessWorker:
    """What the fixture yields in place of the embedded worker's ``WorkController``.

    The suite's tests only need the fixture to have run (``manager`` depends on it,
    ``test_properties`` asks for it); none reads its attributes.
    """

    app: Any
    hostname: str
    pid: int
    argv: list[str]
    log: Path
    status: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session", name="celery_session_worker")
def subprocess_session_worker(
    request: Any,
    celery_session_app: Any,
    celery_config: Any,
    celery_parameters: Any,
    celery_includes: Any,
    celery_class_tasks: Any,
    celery_worker_pool: Any,
    celery_worker_parameters: Any,
) -> Iterator[SubprocessWorker]:
    """Session fixture: the suite's shared worker, a ``celery worker`` subprocess."""
    from celery.utils.nodenames import anon_nodename

    if celery_parameters or celery_worker_parameters:
        pytest.fail(
            "celery_parameters / celery_worker_parameters are set "
            f"({celery_parameters!r}, {celery_worker_parameters!r}): the subprocess worker "
            "does not translate them to command-line flags; run with --worker embedded"
        )
    # The publishing side, as the embedded fixture prepares it.
    for module in celery_includes:
        celery_session_app.loader.import_task_module(module)
    for class_task in celery_class_tasks:
        celery_session_app.register_task(class_task)

    config = request.config
    workdir = Path(
        config.getoption("--celery-fair-worker-dir") or tempfile.mkdtemp(prefix="celery-it-worker-")
    )
    workdir.mkdir(parents=True, exist_ok=True)
    status_path, log_path = workdir / "status.json", workdir / "worker.log"
    status_path.unlink(missing_ok=True)
    fair = bool(config.getoption("--celery-fair-install"))
    spec = {
        "main": celery_session_app.main,
        "config": dict(celery_config),
        "includes": sorted(celery_includes),
        "class_tasks": [f"{cls.__module__}:{cls.__qualname__}" for cls in celery_class_tasks],
        "fair": fair,
        "keyed": fair and bool(config.getoption("--celery-fair-keys")),
        "status": str(status_path),
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, default=_jsonable, indent=2))

    hostname = anon_nodename()
    argv = [*_celery_command(), "-A", APP_MODULE, "worker", "-n", hostname, "-l", "INFO"]
    if celery_worker_pool != "prefork":
        argv += ["-P", str(celery_worker_pool)]
    argv += shlex.split(config.getoption("--celery-fair-worker-args") or "")
    rootdir = str(config.rootpath)
    env = dict(os.environ, CELERY_FAIR_IT_WORKER=str(spec_path))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (rootdir, str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p
    )
    record: dict[str, Any] = {
        "kind": "subprocess",
        "hostname": hostname,
        "argv": [Path(argv[0]).name, *argv[1:]],
        "fair_step": False,
        "fair_service": False,
    }
    WORKERS.append(record)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    record["pid"] = proc.pid
    started = time.monotonic()
    try:
        status = _wait_ready(celery_session_app, proc, hostname, status_path, log_path)
        record.update(status, ready_s=round(time.monotonic() - started, 1))
        _ping_task(celery_session_app)
        yield SubprocessWorker(celery_session_app, hostname, proc.pid, argv, log_path, status)
        if fair:
            record["fair_stats"] = _fair_stats(celery_session_app, hostname)
    finally:
        record.update(_stop(proc))
        record["log_errors"] = _log_errors(log_path)


def _celery_command() -> list[str]:
    """The venv's ``celery`` script, as a deployment runs it; else ``python -m celery``."""
    script = Path(sys.executable).parent / "celery"
    return [str(script)] if script.exists() else [sys.executable, "-m", "celery"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value, key=str)
    raise TypeError(f"celery_config value {value!r} cannot be passed to the worker subprocess")


def _wait_ready(
    app: Any, proc: subprocess.Popen[bytes], hostname: str, status_path: Path, log_path: Path
) -> dict[str, Any]:
    """Poll until the worker has written its status and answers a ping, within READY_TIMEOUT."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        code = proc.poll()
        if code is not None:
            raise RuntimeError(
                f"celery worker exited with status {code} before it was ready:\n{_tail(log_path)}"
            )
        if status_path.exists() and app.control.ping(destination=[hostname], timeout=1.0):
            return dict(json.loads(status_path.read_text()))
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"celery worker {hostname} not ready after {READY_TIMEOUT:g} s:\n{_tail(log_path)}"
            )
        if not status_path.exists():
            # Wait on the process itself, not a sleep: returns at once if it exits.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)


def _ping_task(app: Any) -> None:
    """Run ``celery.ping`` through the worker, as ``start_worker``'s ping check does."""
    from celery.result import allow_join_result

    with allow_join_result():
        reply = app.tasks["celery.ping"].delay().get(timeout=10.0)
    if reply != "pong":
        raise RuntimeError(f"celery.ping returned {reply!r}")


def _fair_stats(app: Any, hostname: str) -> dict[str, Any]:
    """What the worker's celery-fair served (``inspect fair_stats``), short."""
    try:
        replies = app.control.broadcast(
            "fair_stats", destination=[hostname], reply=True, timeout=5.0
        )
    except Exception as exc:  # the record says so; the run goes on
        return {"error": repr(exc)}
    stats = next((r[hostname] for r in replies or () if hostname in r), None)
    if not isinstance(stats, dict):
        return {"error": f"no fair_stats reply from {hostname}"}
    keys = stats.get("keys") or {}
    return {
        "atomic_fetch": stats.get("atomic_fetch"),
        "compat_fallbacks": stats.get("compat_fallbacks"),
        "bad_input": stats.get("bad_input"),
        "keys": {
            "queues": keys.get("queues"),
            "served": keys.get("served"),
            "unkeyed": keys.get("unkeyed"),
            "top": (keys.get("top") or [])[:10],
        }
        if keys
        else None,
    }


def _stop(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Warm shutdown: SIGTERM to the main process; SIGKILL after STOP_TIMEOUT."""
    code = proc.poll()
    if code is not None:
        return {"exit_status": code, "stopped_by": "had exited"}
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT)
        how = "SIGTERM (warm shutdown)"
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        how = f"SIGKILL: no exit {STOP_TIMEOUT:g} s after SIGTERM"
    return {"exit_status": code, "stopped_by": how, "stop_s": round(time.monotonic() - started, 1)}


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _log_errors(path: Path, limit: int = 20) -> list[str]:
    """The worker log's CRITICAL lines (a crashed consumer says so there), for the result file."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = [line[:300] for line in text if "CRITICAL" in line or "Unrecoverable" in line]
    return found[:limit]
