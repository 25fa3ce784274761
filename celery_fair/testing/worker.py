"""A real ``celery worker`` of the user's app in a subprocess, ready when it answers a ping."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from .._process import alive
from .processes import poll_until
from .records import RECORD_DIR_ENV, TaskRecord, read_records

if TYPE_CHECKING:
    from celery import Celery

__all__ = ("FairWorker", "WorkerFailed", "app_path")

#: The module the worker imports (``--include``) to record the tasks it runs.
HOOKS = "celery_fair.testing.hooks"


class WorkerFailed(RuntimeError):
    """The worker exited, or did not become ready in time; the message ends with its log."""


def app_path(app: Celery | str) -> str:
    """The ``-A`` argument that names ``app``.

    A string is taken as it is.  For an app object: ``module:attribute`` of
    a module that holds it, preferring the module named as the app
    (``Celery("proj")``), then one that defines its tasks, then any but a
    test module; Celery's, Kombu's and pytest's own modules are left out.
    """
    if isinstance(app, str):
        return app
    tasks = getattr(app, "tasks", None) or {}
    task_modules = {
        getattr(task, "__module__", None) for name, task in tasks.items()
        if not name.startswith("celery.")
    }  # fmt: skip
    found: list[tuple[tuple[bool, bool, bool], int, str]] = []
    for order, (name, module) in enumerate(list(sys.modules.items())):
        if name == "__main__" or not isinstance(module, ModuleType):
            continue
        if name.split(".")[0] in _FOREIGN:
            continue
        for attr, value in list(vars(module).items()):
            if value is app:
                leaf = name.rsplit(".", 1)[-1]
                testish = leaf.startswith("test_") or leaf == "conftest"
                rank = (name == getattr(app, "main", None), name in task_modules, not testish)
                found.append((rank, -order, f"{name}:{attr}"))
                break
    if not found:
        raise ValueError(
            f"cannot find a module holding {app!r}: pass the app's -A path, e.g. 'proj.celery:app'"
        )
    return max(found)[2]


#: Packages whose modules may hold a reference to an app without naming it for ``-A``.
_FOREIGN = frozenset({"celery", "kombu", "billiard", "pytest", "_pytest", "pluggy"})


def _children(pid: int) -> set[int]:
    """The PIDs of ``pid``'s children, from /proc (Linux); empty elsewhere."""
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
    return found


class FairWorker:
    """``celery -A APP -b BROKER worker ...`` in a subprocess, as your deployment runs it.

    ``app``: the ``-A`` argument (``"proj.celery:app"``) or the app object
    (its module is found).  ``broker_url``: passed as ``-b``, which Celery
    prefers to the app's ``broker_url``.  ``queues`` (``-Q``),
    ``concurrency`` (``-c``) and ``pool`` (``-P``): Celery's defaults when
    omitted.  ``settings``: Celery settings for this worker only (e.g.
    ``{"fair_weights": {"p0": 4, "p1": 1}}``), given on Celery's command line
    as ``name=(json)value``; they must be JSON (set a callable in the app
    module).  ``args``: more ``celery worker`` options.  ``env``: more
    environment.  ``record``: record each task run (read with
    :meth:`records`).

    :meth:`start` returns once the worker answers ``app.control.ping``
    (polled until ``ready_timeout``); :meth:`stop` shuts it down warmly
    (SIGTERM to its PID), kills its process group past ``stop_timeout``, and
    kills by PID any pool process left over.  The subprocess sees the test
    process's ``sys.path`` (``PYTHONPATH``), so it imports what the test imports.
    """

    def __init__(
        self,
        app: Celery | str,
        broker_url: str,
        *,
        queues: Sequence[str] = (),
        concurrency: int | None = None,
        pool: str | None = None,
        settings: Mapping[str, Any] | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        loglevel: str = "INFO",
        record: bool = True,
        ready_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        cwd: str | os.PathLike[str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.app = app_path(app)
        self.broker_url = broker_url
        self.queues = list(queues)
        self.concurrency = concurrency
        self.pool = pool
        self.settings = dict(settings or {})
        self.args = list(args)
        self.env = dict(env or {})
        #: The worker's node name, as ``-n`` sets it and ``-d`` addresses it.
        self.nodename = f"{name or 'fair-test-' + uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        self.loglevel = loglevel
        self.record = record
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.cwd = cwd
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="celery-fair-worker-"))
        self.records_dir = self.workdir / "records"
        self.log_path = self.workdir / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._pids: set[int] = set()

    # -- the command -------------------------------------------------------

    def command(self) -> list[str]:
        """The command line the worker runs with."""
        argv = [sys.executable, "-m", "celery", "-A", self.app, "-b", self.broker_url, "worker"]
        argv += ["-n", self.nodename, "-l", self.loglevel]
        if self.queues:
            argv += ["-Q", ",".join(self.queues)]
        if self.concurrency is not None:
            argv += ["-c", str(self.concurrency)]
        if self.pool is not None:
            argv += ["-P", self.pool]
        if self.record:
            argv += ["--include", HOOKS]
        argv += self.args
        argv += [f"{k}=(json){json.dumps(v)}" for k, v in self.settings.items()]
        return argv

    def environment(self) -> dict[str, str]:
        """The worker's environment: the test's, its ``sys.path``, the records' directory."""
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"
        if self.record:
            env[RECORD_DIR_ENV] = str(self.records_dir)
        env.update(self.env)
        return env

    # -- life cycle --------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's main process, while it runs."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> FairWorker:
        """Start the worker and wait until it answers a ping (raises :class:`WorkerFailed`)."""
        if self.proc is not None:
            raise RuntimeError("this worker is running already")
        self.records_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), env=self.environment(), cwd=self.cwd, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def ping(self, timeout: float = 1.0) -> bool:
        """Whether this worker answers Celery's ``ping`` (remote control) now."""
        from celery import Celery

        control = Celery(
            "celery_fair_testing_control", broker=self.broker_url, set_as_current=False
        )
        try:
            replies = control.control.ping(destination=[self.nodename], timeout=timeout) or []
        except Exception:  # noqa: BLE001 - the broker or the worker is not there yet
            return False
        finally:
            control.close()
        return any(self.nodename in reply for reply in replies)

    def wait_ready(self, timeout: float) -> None:
        """Poll :meth:`ping` until the worker answers; raise if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if self.ping(timeout=1.0):
                self._pids = self.pids()
                return
            if time.monotonic() > deadline:
                raise WorkerFailed(
                    f"worker {self.nodename} did not answer a ping in {timeout:g}s:\n{self.log()}"
                )

    def check_alive(self) -> None:
        """Raise :class:`WorkerFailed` (with the log) if the worker process has exited."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise WorkerFailed(
                f"worker {self.nodename} is not running (exit {code}):\n{self.log()}"
            )

    def pids(self) -> set[int]:
        """The worker's main process and its children (the pool) now, by PID."""
        if self.proc is None or self.proc.poll() is not None:
            return set()
        return {self.proc.pid, *_children(self.proc.pid)}

    def stop(self) -> int | None:
        """Warm shutdown: SIGTERM to the main process, which waits for running tasks.

        Past ``stop_timeout`` the worker's process group is killed.  Any
        process of the worker seen since it started (:meth:`pids`) that still
        runs afterwards is killed by its PID.  Returns the exit status (None
        if it had to be killed, or never started).
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        seen = self._pids | {proc.pid} | (_children(proc.pid) if proc.poll() is None else set())
        code: int | None = proc.poll()
        if code is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                code = None
        left = {pid for pid in seen if pid != proc.pid and alive(pid)}
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        poll_until(lambda: not any(alive(pid) for pid in left), timeout=10)
        return code

    def close(self) -> None:
        """Stop the worker and remove its working directory (if it made it)."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> FairWorker:
        """Start the worker (unless it runs already); it stops when the block ends."""
        return self if self.proc is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what it did -------------------------------------------------------

    def log(self, tail: int = 5000) -> str:
        """The end of the worker's log (stdout and stderr)."""
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-tail:]

    def records(self) -> list[TaskRecord]:
        """Every task run recorded so far, ordered by start time."""
        return read_records(self.records_dir)

    def wait_for_records(
        self, n: int, *, timeout: float = 60.0, where: Iterable[str] | None = None
    ) -> list[TaskRecord]:
        """Poll until at least ``n`` runs are recorded (of the task names ``where``, if
        given) and return every record; raises if the worker exits or ``timeout`` passes."""
        names = None if where is None else set(where)
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            records = self.records()
            count = len(records if names is None else [r for r in records if r.name in names])
            if count >= n:
                return records
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{count} of {n} tasks recorded in {timeout:g}s by {self.nodename}:\n"
                    f"{self.log()}"
                )
            time.sleep(0.05)
