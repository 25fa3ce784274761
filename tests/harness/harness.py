"""Run a real ``celery worker`` against pre-filled Redis queues and count.

Shared by the integration tests, the benchmarks and the demo.  Queues are
filled with messages made by Celery's own producer (one is published, its
raw form is copied with fresh ids), then a worker subprocess consumes while
the harness samples the queue lengths; consumption per queue is the drop in
length, so tasks need no side effects and the count costs the worker nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from celery_fair.testing import poll_until

from .brokers import broker_for

__all__ = (
    "QUICK_STOP", "RunResult", "WorkerProcess", "fill_queues", "poll_until", "run_backlogged",
    "wait_unacked_restorable",
)  # fmt: skip

WORKLOAD = "tests.harness.workload"


def fill_queues(
    broker_url: str,
    counts: Mapping[str, int],
    *,
    task: str = "work",
    args: Sequence[object] | Mapping[str, Sequence[object]] = (0,),
) -> None:
    """Push ``counts[q]`` task messages onto each queue ``q`` (Redis or AMQP).

    ``args`` is the task's positional arguments, or a mapping queue -> args.
    """
    broker_for(broker_url).fill(counts, task=task, args=args)


def wait_unacked_restorable(broker_url: str, visibility: float, timeout: float = 60.0) -> int:
    """Wait until every message in Redis's unacked index is past ``visibility`` seconds.

    For a worker that died holding messages: a worker started after this
    restores them all at once, in the scan Kombu's Redis transport makes when
    it starts consuming (``on_poll_init``).  A worker that was already running
    would find them only at its next periodic scan: on Kombu before 5.7
    (no ``unacked_restore_interval`` nor ``unacked_restore_throttle`` option)
    every 10th call of a 10 s timer, up to 100 s later.  Nothing may write
    the index meanwhile (no live worker on ``broker_url``).  Returns the
    number of unacknowledged messages.
    """
    import redis

    client = redis.Redis.from_url(broker_url)
    deadline = time.monotonic() + timeout
    while True:
        newest = client.zrange("unacked_index", -1, -1, withscores=True)
        # The scores are the fetching worker's time.time(), on this machine.
        if not newest or newest[0][1] <= time.time() - visibility:
            return int(client.zcard("unacked_index"))
        assert time.monotonic() < deadline, f"unacked for more than {timeout} s: {newest}"
        time.sleep(0.1)


#: The grace a test gives a worker it stops once its measurement is over, before the
#: process group is killed. A warm shutdown of a busy prefork worker waits 30 s
#: whenever a child finished a task as the shutdown began and the main process,
#: its event loop stopped, no longer reads the result (billiard's
#: ``_ensure_messages_consumed``; plain Celery as well). Tests of the shutdown itself
#: keep the full wait.
QUICK_STOP = 5.0


@dataclass
class WorkerProcess:
    """A ``celery worker`` subprocess of the workload app."""

    broker_url: str
    queues: Sequence[str]
    pool: str = "prefork"
    concurrency: int = 2
    fair: bool = True
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    name: str = field(default_factory=lambda: f"fair-{uuid.uuid4().hex[:8]}")
    #: The ``-A`` module of the worker.
    app: str = WORKLOAD

    def start(self) -> WorkerProcess:
        env = dict(os.environ)
        env.update(
            CELERY_FAIR_BROKER=self.broker_url,
            CELERY_FAIR="1" if self.fair else "0",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency),
            "-Q", ",".join(self.queues),
            "-l", "INFO", "-n", f"{self.name}@%h",
            *self.extra_args,
        ]  # fmt: skip
        # The test session's folder when there is one (tests/conftest.py).
        folder = os.environ.get("CELERY_FAIR_TEST_LOGS") or None
        fd, path = tempfile.mkstemp(prefix="celery-fair-worker-", suffix=".log", dir=folder)
        self.log_path = Path(path)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 45.0) -> int | None:
        """Warm shutdown, as ``celery multi stopwait`` or systemd's ``KillMode=mixed`` does it.

        SIGTERM goes to the main process only: it stops consuming, puts its
        prefetched messages back and waits for the running tasks.  A TERM to
        the whole process group would kill the pool's children mid-task (a
        task acknowledged early is then lost, with plain Celery as well).
        Past ``timeout`` the group is killed (and what the worker had
        prefetched waits in Redis's unacked index for the visibility
        timeout).  The default outlasts billiard's own wait: a prefork child
        that finished a task as the shutdown began waits up to 30 s for the
        main process to read its result (``_ensure_messages_consumed``,
        300 x 0.1 s), plain Celery as well.  Returns the exit status.
        """
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        try:
            proc.send_signal(signal.SIGTERM)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            return None

    def kill(self) -> None:
        """A crash: SIGKILL to the whole process group (main process and pool), reaped.

        Nothing is put back: what the worker held waits for Redis's visibility
        timeout (or RabbitMQ's redelivery).
        """
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class RunResult:
    """Per-queue consumption over one measured interval."""

    consumed: dict[str, int]
    elapsed: float
    #: CPU seconds (user + system) the workers' main processes used in the interval.
    main_cpu: float | None = None
    #: CPU seconds the workers' pool processes (their children) used in the interval.
    pool_cpu: float | None = None

    @property
    def total(self) -> int:
        return sum(self.consumed.values())

    @property
    def rate(self) -> float:
        return self.total / self.elapsed if self.elapsed > 0 else 0.0

    def shares(self) -> dict[str, float]:
        total = self.total or 1
        return {q: n / total for q, n in self.consumed.items()}


def run_backlogged(
    broker_url: str,
    counts: Mapping[str, int],
    *,
    target: int,
    warmup: int = 0,
    pool: str = "prefork",
    concurrency: int = 2,
    fair: bool = True,
    task: str = "work",
    args: Sequence[object] | Mapping[str, Sequence[object]] = (0,),
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 300.0,
    on_sample: Callable[[dict[str, int], float], None] | None = None,
    workers: int = 1,
    stop_timeout: float = QUICK_STOP,
) -> RunResult:
    """Fill the queues, run one worker, and measure ``target`` consumed tasks.

    The interval starts once ``warmup`` tasks are consumed (worker start-up
    excluded) and ends when ``target`` more are.  ``target`` must stay below
    what would empty any queue, so every queue stays backlogged.
    ``on_sample(consumed, elapsed)`` is called on every sample (progress).
    ``workers`` separate worker processes consume the same queues.
    ``stop_timeout`` is the grace of the warm shutdown afterwards: a test that
    reads what a worker writes as it stops (telemetry) gives the full wait.
    """
    broker = broker_for(broker_url, quorum=bool((env or {}).get("CELERY_FAIR_QUORUM_QUEUES")))
    broker.purge(counts)
    broker.fill(counts, task=task, args=args)
    initial = broker.lengths(counts)
    pool_of_workers = [
        WorkerProcess(
            broker_url,
            list(counts),
            pool=pool,
            concurrency=concurrency,
            fair=fair,
            env=env or {},
            extra_args=extra_args,
        )  # fmt: skip
        for _ in range(workers)
    ]
    deadline = time.monotonic() + timeout
    try:
        for worker in pool_of_workers:
            worker.start()
        start_counts: dict[str, int] | None = None
        started = 0.0
        cpu_start: float | None = None
        pool_start: dict[int, float] = {}
        while True:
            if time.monotonic() > deadline:
                logs = "\n".join(w.log()[-2000:] for w in pool_of_workers)
                raise TimeoutError(f"workers did not consume {target} tasks:\n{logs}")
            for worker in pool_of_workers:
                if worker.proc is not None and worker.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early:\n{worker.log()[-3000:]}")
            now = time.monotonic()
            lengths = broker.lengths(counts)
            consumed = {q: initial[q] - lengths[q] for q in counts}
            total = sum(consumed.values())
            if start_counts is None:
                if total >= max(1, warmup):
                    start_counts, started = consumed, now
                    cpu_start = _main_cpu(pool_of_workers)
                    pool_start = _pool_cpu(pool_of_workers)
            else:
                if on_sample is not None:
                    on_sample({q: consumed[q] - start_counts[q] for q in counts}, now - started)
                if total - sum(start_counts.values()) < target:
                    time.sleep(0.005)
                    continue
                cpu_end = _main_cpu(pool_of_workers)
                pool_end = _pool_cpu(pool_of_workers)
                return RunResult(
                    consumed={q: consumed[q] - start_counts[q] for q in counts},
                    elapsed=now - started,
                    main_cpu=(
                        None if cpu_start is None or cpu_end is None else cpu_end - cpu_start
                    ),
                    # A pool process that started during the interval counts from 0.
                    pool_cpu=(
                        sum(t - pool_start.get(pid, 0.0) for pid, t in pool_end.items())
                        if pool_end
                        else None
                    ),
                )
            time.sleep(0.005)
    finally:
        for worker in pool_of_workers:
            worker.stop(stop_timeout)  # measured; the queues are purged next
        broker.purge(counts)


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of one process (Linux ``/proc``), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces) start at ")".
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _main_cpu(workers: Sequence[WorkerProcess]) -> float | None:
    """User + system CPU seconds of the workers' main processes."""
    total = 0.0
    for worker in workers:
        cpu = None if worker.proc is None else process_cpu(worker.proc.pid)
        if cpu is None:
            return None
        total += cpu
    return total


def _pool_cpu(workers: Sequence[WorkerProcess]) -> dict[int, float]:
    """CPU seconds of each live pool process (child) of the workers, by pid."""
    found: dict[int, float] = {}
    for worker in workers:
        if worker.proc is None:
            continue
        pid = worker.proc.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            cpu = process_cpu(child)
            if cpu is not None:
                found[child] = cpu
    return found
