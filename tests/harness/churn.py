"""Churn soak (#49, "Nothing stranded"): pool processes replaced, killed, time-limited
and revoked under a backlog, and every task accounted for.

Two ``celery worker`` processes of :mod:`tests.integration.production_app`, started
as deployments start them: Celery's defaults (mingle, gossip, heartbeat) plus
``-E -O fair``, late acks with a prefetch multiplier of 1, a Redis result backend
(on the broker's own Redis when the broker is Redis), ``visibility_timeout`` 3600 on
Redis.  Worker ``b`` replaces its pool children every ``--max-tasks-per-child``
tasks; worker ``a`` runs ``--autoscale 3,1``, growing in each wave of tasks and
shrinking in the pause after it.  Both have a hard ``--time-limit``.

The queues are ``hi`` and ``lo`` (weights 4:1) and ``jobs``, keyed by tenant
(``fair_keys``; on RabbitMQ served from its lanes, which the counts include).  The
tasks (``prod.churn``, 2 ms) are published in waves; a share sleeps 300 ms (the
targets of the revokes), a share
sleeps beyond a hard time limit (half the worker's ``--time-limit``, half a
``time_limit`` of their own), a share has a countdown.  While the waves run, a churn
thread SIGKILLs a random pool process of a random worker every ``kill_every``
seconds and revokes, with ``terminate=True``, running slow tasks and a task still
waiting.

Then every published task is accounted for, per Celery's at-least-once rules: it
ran once and succeeded, or its result says why not: ``TimeLimitExceeded`` (a hard
time limit), ``WorkerLostError`` (a pool process killed under it: with late acks
and ``task_reject_on_worker_lost`` off, Celery marks it failed and acknowledges
it; a process killed as the task started, before the main process knew the job
was on it, is not seen as holding the job: the task's hard time limit ends it, plain
Celery as well; or a process ``--autoscale`` shrank as the job reached it: billiard
counts it idle until the process acknowledges the job, and SIGTERMs it, plain Celery
as well), ``REVOKED``.  A task with no such result and no run is **lost** (stranded:
where it is, is reported); a task that started twice is a duplicate, explained
when an earlier run's process was one the churn killed.  The run ends with
nothing on the broker (Redis: no message waiting and the ``unacked`` hash empty
while the workers still run; RabbitMQ: no message ready or unacknowledged), the
shares hold while ``hi`` and ``lo`` are both backlogged, and no worker logs a
stall (``celery-fair: stall``, the worker's watchdog).

:func:`run_churn` is the run, short in ``tests/integration/test_churn.py``; the soak
(:mod:`bench.churn`) runs it long and writes the results:

    python -m bench.soak --churn [--tasks 100000] [--reps 1] [--only redis|rabbitmq]
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import redis as redis_lib

from celery_fair.keys.lanes import KeyLanes
from tests.harness.brokers import AmqpBroker, _glob_escape
from tests.harness.harness import WorkerProcess
from tests.harness.keys import most_at_once
from tests.harness.redis import RedisServer

__all__ = ("Churn", "account", "log_lines", "run_churn", "wave_shares")

APP = "tests.integration.production_app"
TASK = "prod.churn"
#: The deployment flags of both workers, besides Celery's defaults.
FLAGS = ("-E", "-O", "fair")
WEIGHTS = {"hi": 4, "lo": 1}
#: A queue keyed by tenant (weight 1, the default).
KEYED = "jobs"
#: Every tenant's backlog cap in ``jobs``, never reached: on RabbitMQ each keyed task
#: is counted in its tenant's counter, and every place must be free at the end.
BACKLOG_CAP = 1_000_000
#: Tasks published per queue, in proportion: hi and lo equal, so that with 4:1 hi
#: runs dry first and the window where both are backlogged is most of a wave.
MIX = {"hi": 2, "lo": 2, KEYED: 1}
VISIBILITY = 3600
#: Milliseconds a task sleeps: quick, slow (revoked while it runs), over a time limit.
MS, SLOW_MS, OVER_MS = 2, 300, 4000
#: The workers' hard ``--time-limit`` (s), and the ``time_limit`` of half the over tasks.
WORKER_TIME_LIMIT, TASK_TIME_LIMIT = 1.5, 0.4
#: Countdowns (s) of the countdown tasks.
COUNTDOWNS = (1, 2, 3)
#: Celery's autoscaler shrinks a pool only after 30 s without a task received
#: (``AUTOSCALE_KEEPALIVE``); 2 s makes it shrink in the pause between waves.
KEEPALIVE = 2.0
#: Runs skipped at the start of a wave, and before the first queue ran dry, for the shares.
WARMUP, TAIL = 20, 20
#: Seconds from a kill to the WorkerLostError result of a job sent to the process.
KILL_SLACK = 3.0
#: An outcome: a task whose process was killed as it started, ended by the hard time limit.
KILLED_AS_STARTED = "killed as it started (ended by the time limit)"
#: ``resources=True``: each worker's capacity, a per-queue limit and DRF charges, and
#: what the tasks declare (a slow task twice a quick one's CPU).  On worker ``b``
#: (2 processes) ``slots`` binds; on ``a`` (``--autoscale 3,1``) CPU does when a
#: slow task runs.  The books must come back to nothing held after the churn.
CAPACITY = {"cpu": 3.0}
QUEUE_CONCURRENCY = {"lo": 1}
DEMANDS = {"slow": {"cpu": 2.0}, "*": {"cpu": 1.0}}
#: ``priorities=True``: the queues are declared with a maximum priority, each task has
#: one of these priorities (three levels), and the levels share by weight
#: (``fair_priority="weighted"``; on RabbitMQ a keyed queue then has lanes per level).
MAX_PRIORITY = 10
PRIORITIES = (0, 4, 9)
#: An outcome: a task whose process ``--autoscale`` terminated as the job reached it.
SHRUNK_AS_STARTED = "terminated by an autoscale shrink as it started"
#: A worker's log: what the churn causes, and what is a bug.
STALL = "celery-fair: stall"
UP_TIMEOUT = "Timed out waiting for UP message"
EXPECTED_ERRORS = (
    "Hard time limit",
    "WorkerLostError",
    "exited with 'signal 9 (SIGKILL)'",
    "exited with 'signal 15 (SIGTERM)'",
    "Terminated",
    "TimeLimitExceeded",
    "Worker exited prematurely",
)


@dataclass(frozen=True)
class Spec:
    """One task to publish."""

    queue: str
    kind: str  # quick, slow, over-worker, over-task, countdown
    tenant: str


def plan(tasks: int, waves: int, rng: random.Random, *, queues: Sequence[str], tenants: int,
         slow: float, over: float, countdown: float) -> list[list[Spec]]:  # fmt: skip
    """The tasks of each wave, the queues interleaved at random in ``MIX``'s proportions."""
    weights = [MIX[q] for q in queues]
    per_wave = [tasks // waves + (1 if w < tasks % waves else 0) for w in range(waves)]
    out = []
    for n in per_wave:
        total = sum(weights)
        counts = [n * w // total for w in weights]
        counts[0] += n - sum(counts)
        order = [q for q, c in zip(queues, counts, strict=True) for _ in range(c)]
        rng.shuffle(order)
        wave = []
        for q in order:
            r = rng.random()
            kind = (
                "slow" if r < slow
                else ("over-worker" if rng.random() < 0.5 else "over-task") if r < slow + over
                else "countdown" if r < slow + over + countdown
                else "quick"
            )  # fmt: skip
            wave.append(Spec(q, kind, f"t{rng.randrange(tenants)}"))
        out.append(wave)
    return out


@dataclass
class Published:
    id: str
    spec: Spec
    wave: int
    at: float


def publish(producer: Any, specs: Sequence[Spec], wave: int, rng: random.Random,
            sink: Callable[[Published], None], resources: bool = False,
            priorities: bool = False) -> None:  # fmt: skip
    """``prod.churn(value, ms, tenant)``, positionally, as users call it.

    ``resources``: each call declares what it holds (:data:`DEMANDS`).
    ``priorities``: each call has a Celery priority from :data:`PRIORITIES`."""
    task = producer.tasks[TASK]
    with producer.producer_or_acquire() as conn:
        for spec in specs:
            options: dict[str, Any] = {}
            ms: float = MS
            if spec.kind == "slow":
                ms = SLOW_MS
            elif spec.kind.startswith("over"):
                ms = OVER_MS
                if spec.kind == "over-task":
                    options["time_limit"] = TASK_TIME_LIMIT
            elif spec.kind == "countdown":
                options["countdown"] = rng.choice(COUNTDOWNS)
            if resources:
                options["fair_resources"] = DEMANDS.get(spec.kind, DEMANDS["*"])
            if priorities:
                options["priority"] = rng.choice(PRIORITIES)
            result = task.apply_async(
                (spec.queue, ms, spec.tenant), queue=spec.queue, producer=conn, **options
            )
            sink(Published(result.id, spec, wave, time.time()))


def pool_children(pid: int) -> list[int]:
    """The pool processes of a worker's main process (Linux ``/proc``)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Churn:
    """Kills a random pool process every ``kill_every`` s, revokes every ``revoke_every`` s.

    Only processes this run started are signalled: the children of the two
    workers' main processes, by pid.  A revoke takes up to two slow tasks that
    started in the last 150 ms (still running: they sleep 300 ms) and one task
    published but not started yet (waiting on the broker or reserved by a worker).
    """

    workers: dict[str, WorkerProcess]  # by node name
    control: Any  # a Celery app: control.revoke
    ledger: redis_lib.Redis
    kill_every: float
    revoke_every: float
    rng: random.Random
    published: list[Published] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    revokes: list[dict[str, Any]] = field(default_factory=list)
    #: Pool processes seen, per worker: polled every 0.1 s.
    seen: dict[str, set[int]] = field(default_factory=dict)
    started: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _read: int = 0
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        now = time.monotonic()
        next_kill, next_revoke = now + self.kill_every, now + self.revoke_every
        while not self.stop.wait(0.1):
            try:
                self._look()
                now = time.monotonic()
                if now >= next_kill:
                    next_kill = now + self.kill_every
                    self._kill()
                if now >= next_revoke:
                    next_revoke = now + self.revoke_every
                    self._revoke()
            except Exception as exc:  # noqa: BLE001 - reported in the record, the run goes on
                self.errors.append(repr(exc))

    def _look(self) -> None:
        for node, worker in self.workers.items():
            if worker.proc is not None:
                self.seen.setdefault(node, set()).update(pool_children(worker.proc.pid))
        for raw in self.ledger.lrange("ledger:starts", self._read, -1):  # type: ignore[union-attr]
            self._read += 1
            entry = json.loads(raw)
            self.started.setdefault(entry["id"], entry)

    def _kill(self) -> None:
        nodes = [n for n, w in self.workers.items() if w.proc is not None]
        if not nodes:
            return
        node = self.rng.choice(nodes)
        proc = self.workers[node].proc
        children = pool_children(proc.pid) if proc is not None else []
        if not children:
            return
        pid = self.rng.choice(children)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"at": time.time(), "worker": node, "pid": pid})

    def _revoke(self) -> None:
        now = time.time()
        running = [
            e["id"] for e in list(self.started.values())[-2000:]
            if now - e["started"] < 0.15 and e["id"] in self._slow()
        ]  # fmt: skip
        ids = self.rng.sample(running, min(2, len(running)))
        recent = self.published[-5000:]
        waiting = [p.id for p in recent if p.id not in self.started and p.spec.kind == "quick"]
        if waiting:
            ids.append(self.rng.choice(waiting))
        if ids:
            self.control.control.revoke(ids, terminate=True)
            for tid in ids:
                self.revokes.append({"at": now, "id": tid, "running": tid in running})

    def _slow(self) -> set[str]:
        return {p.id for p in self.published[-5000:] if p.spec.kind == "slow"}


# -- the broker ---------------------------------------------------------------------


def redis_waiting(client: redis_lib.Redis, queues: Iterable[str]) -> int:
    """Messages waiting in the queues' lists: Kombu's own, priority levels and fair keys."""
    total = 0
    for q in queues:
        names = [q.encode(), *client.scan_iter(match=_glob_escape(q) + "\x06\x16*", count=1000)]
        for name in names:
            if client.type(name) == b"list":
                total += int(client.llen(name))  # type: ignore[arg-type]
    return total


def rabbitmq_counts(server: Any, queues: Sequence[str]) -> dict[str, tuple[int, int]] | None:
    """``(ready, unacknowledged)`` per queue, from ``rabbitmqctl`` (None: it failed)."""
    done = server.ctl(
        "rabbitmqctl", "list_queues", "-q", "--no-table-headers",
        "name", "messages_ready", "messages_unacknowledged",
    )  # fmt: skip
    if done.returncode != 0:
        return None
    out = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in queues:
            out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


@dataclass
class Broker:
    """The queues on either broker: what waits, what is held unacknowledged."""

    kind: str
    url: str
    queues: Sequence[str]
    rabbitmq: Any = None

    def waiting(self) -> int:
        if self.kind == "redis":
            return redis_waiting(redis_lib.Redis.from_url(self.url), self.queues)
        with contextlib.suppress(Exception):  # a queue not declared yet
            return sum(AmqpBroker(self.url).lengths(self.queues).values())
        return -1

    def markers(self, counters: Sequence[str]) -> tuple[int, int] | None:
        """RabbitMQ: how many of backlog ``counters`` exist, and the markers left in them
        (None on Redis, or unknown)."""
        if self.kind != "rabbitmq" or self.rabbitmq is None:
            return None
        counts = rabbitmq_counts(self.rabbitmq, counters)
        return None if counts is None else (len(counts), sum(r + u for r, u in counts.values()))

    def left(self) -> dict[str, int | None]:
        """Messages waiting, and messages delivered but not acknowledged."""
        if self.kind == "redis":
            client = redis_lib.Redis.from_url(self.url)
            return {"waiting": self.waiting(), "unacked": int(client.hlen("unacked"))}  # type: ignore[arg-type]
        counts = rabbitmq_counts(self.rabbitmq, self.queues) if self.rabbitmq else None
        if counts is None:
            return {"waiting": self.waiting(), "unacked": None}
        return {"waiting": sum(r for r, _ in counts.values()),
                "unacked": sum(u for _, u in counts.values())}  # fmt: skip

    def locate(self, ids: set[str]) -> dict[str, list[str]]:
        """Redis: where tasks with no outcome are (a queue, ``unacked``, nowhere)."""
        if self.kind != "redis" or not ids:
            return {"unknown": sorted(ids)} if ids else {}
        client = redis_lib.Redis.from_url(self.url)
        queued: set[str] = set()
        for q in self.queues:
            names = [q.encode(), *client.scan_iter(match=_glob_escape(q) + "\x06\x16*")]
            for name in names:
                if client.type(name) == b"list":
                    for raw in client.lrange(name, 0, -1):  # type: ignore[union-attr]
                        queued.add(json.loads(raw)["headers"]["id"])
        unacked = {
            json.loads(raw)[0]["headers"]["id"]
            for raw in client.hvals("unacked")  # type: ignore[union-attr]
        }
        found: dict[str, list[str]] = {"queued": [], "unacked": [], "nowhere": []}
        for tid in sorted(ids):
            found["queued" if tid in queued else "unacked" if tid in unacked else "nowhere"].append(
                tid
            )
        return found

    def purge(self) -> None:
        if self.kind == "rabbitmq":
            AmqpBroker(self.url).purge(self.queues)


# -- accounting ---------------------------------------------------------------------


class Outcome(NamedTuple):
    """A task's stored result."""

    status: str
    exc: str | None  # the exception's type, for FAILURE and REVOKED
    message: str | None
    done: float  # date_done, as a timestamp


def outcomes(backend: str, ids: Iterable[str]) -> dict[str, Outcome]:
    """Each task's stored result; tasks without one are left out."""
    client = redis_lib.Redis.from_url(backend)
    ids = list(ids)
    out = {}
    for start in range(0, len(ids), 2000):
        chunk = ids[start : start + 2000]
        for tid, raw in zip(chunk, client.mget([f"celery-task-meta-{t}" for t in chunk]),
                            strict=True):  # fmt: skip
            if raw is None:
                continue
            meta = json.loads(raw)
            result = meta.get("result")
            exc, message = (
                (result.get("exc_type"), str(result.get("exc_message")))
                if isinstance(result, dict) else (None, None)
            )  # fmt: skip
            done = datetime.fromisoformat(meta["date_done"]) if meta.get("date_done") else None
            if done is not None and done.tzinfo is None:
                done = done.replace(tzinfo=timezone.utc)
            out[tid] = Outcome(meta["status"], exc, message, done.timestamp() if done else 0.0)
    return out


TERMINAL = ("SUCCESS", "FAILURE", "REVOKED")


def by_shrink(message: str | None, done: float, shrinks: Iterable[float]) -> bool:
    """Whether a ``WorkerLostError`` (``message``, its result stored at ``done``) is
    ``--autoscale``'s: it names SIGTERM, and the worker logged "Scaling down" (at
    ``shrinks``) in the ``KILL_SLACK`` seconds before.

    billiard's ``shrink`` SIGTERMs a process it counts idle, and a process counts
    idle until it acknowledges the job just written to it: that job dies as it
    starts (plain Celery as well: celery#2587, billiard#323).
    """
    return "SIGTERM" in str(message) and any(0 <= done - t <= KILL_SLACK for t in shrinks)


def account(
    published: Sequence[Published],
    starts: Sequence[dict[str, Any]],
    runs: Sequence[dict[str, Any]],
    results: dict[str, Outcome],
    kills: Sequence[dict[str, Any]],
    revoked: set[str],
    shrinks: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Every task: ran once, or accounted for by a kill, a time limit, a revoke or a shrink.

    A ``WorkerLostError`` is the churn's when the task's run started in a process
    the churn killed, or, for a task whose process died before its run noted its
    start (the job was on its way to the process), when the error names SIGKILL and
    the churn killed a process in the ``KILL_SLACK`` seconds before the result.
    ``shrinks``: per worker (node name), when ``--autoscale`` logged "Scaling down".
    A ``WorkerLostError`` naming SIGTERM is the autoscaler's when its worker (or,
    with no start noted, any worker) shrank in the ``KILL_SLACK`` seconds before.
    """
    started: dict[str, list[dict[str, Any]]] = {}
    for s in starts:
        started.setdefault(s["id"], []).append(s)
    ran = Counter(r["id"] for r in runs)
    killed_pids = {(k["worker"], k["pid"]) for k in kills}
    kill_times = sorted(k["at"] for k in kills)
    kills_of: dict[tuple[str, int], list[float]] = {}
    for k in kills:
        kills_of.setdefault((k["worker"], k["pid"]), []).append(k["at"])

    def killed_between(start: dict[str, Any], done: float) -> bool:
        """Whether the churn killed the process of this run after it started, before ``done``."""
        times = kills_of.get((start["worker"], start["pid"]), [])
        return any(start["started"] <= t <= done for t in times)

    def kill_before(done: float) -> bool:
        i = bisect_right(kill_times, done)
        return i > 0 and done - kill_times[i - 1] <= KILL_SLACK

    shrunk_at = shrinks or {}

    def shrunk_under(starts_of: Sequence[dict[str, Any]], outcome: Outcome) -> bool:
        nodes = {s["worker"] for s in starts_of} or set(shrunk_at)
        times = [t for n in nodes for t in shrunk_at.get(n, ())]
        return by_shrink(outcome.message, outcome.done, times)

    def killed_as_accepted(done: float) -> bool:
        """A kill one hard time limit (the timer starts as a process accepts the job)
        before ``done``, give or take the timer's and the result's delays."""
        lo, hi = done - WORKER_TIME_LIMIT - 1.0, done - WORKER_TIME_LIMIT + 0.2
        i = bisect_right(kill_times, hi)
        return i > 0 and kill_times[i - 1] >= lo

    kinds = {p.id: p.spec.kind for p in published}
    counts: Counter[str] = Counter()
    unexplained: list[dict[str, Any]] = []
    duplicates: Counter[str] = Counter()
    lost: set[str] = set()

    def odd(tid: str, why: str) -> None:
        counts[f"unexplained {why}"] += 1
        if len(unexplained) < 20:
            unexplained.append({"id": tid, "why": why, "kind": kinds[tid],
                                "result": results.get(tid), "runs": ran[tid],
                                "starts": started.get(tid, [])})  # fmt: skip

    for p in published:
        tid, kind = p.id, p.spec.kind
        outcome = results.get(tid)
        status, exc = (outcome.status, outcome.exc) if outcome else (None, None)
        starts_of = sorted(started.get(tid, []), key=lambda s: s["started"])
        by_kill = any((s["worker"], s["pid"]) in killed_pids for s in starts_of)
        if len(starts_of) > 1:
            earlier = starts_of[:-1]
            if all((s["worker"], s["pid"]) in killed_pids for s in earlier):
                duplicates["after a kill"] += len(earlier)
            else:
                duplicates["unexplained"] += len(earlier)
                odd(tid, "duplicate")
        if ran[tid] > 1:
            counts["completed more than once"] += 1
        if status == "SUCCESS":
            counts["succeeded"] += 1
            if ran[tid] == 0:
                odd(tid, "success without a run")
            if kind.startswith("over"):
                odd(tid, "over task not stopped by its time limit")
        elif status == "FAILURE" and exc == "TimeLimitExceeded":
            counts["time limit"] += 1
            assert outcome is not None
            if kind.startswith("over"):
                pass
            elif any(killed_between(s, outcome.done) for s in starts_of) or (
                not starts_of and killed_as_accepted(outcome.done)
            ):
                # The process died as the task started, before the main process
                # knew the job was on it: billiard does not mark the job lost, its
                # hard time limit ends it (plain Celery as well).  Killed before the
                # task's first line, the run noted no start: a kill one hard time
                # limit before the result is then what the churn did.
                counts[KILLED_AS_STARTED] += 1
            elif tid in revoked and starts_of:
                # Revoked with terminate as it ran: the SIGTERM raced the job's
                # accounting and its hard time limit ended it (plain Celery as well).
                counts["revoked while running, ended by its time limit"] += 1
            else:
                odd(tid, "time limit of a task within its limit")
        elif status == "FAILURE" and exc == "WorkerLostError":
            counts["killed (WorkerLostError)"] += 1
            assert outcome is not None
            if by_kill:
                counts["killed while running"] += 1
            elif "SIGKILL" in str(outcome.message) and kill_before(outcome.done):
                counts["killed before its run started"] += 1
            elif shrunk_under(starts_of, outcome):
                counts[SHRUNK_AS_STARTED] += 1
            else:
                odd(tid, "WorkerLostError without a kill")
        elif status == "REVOKED":
            counts["revoked"] += 1
            if tid not in revoked:
                odd(tid, "revoked, not by the churn")
            if starts_of:
                counts["revoked while running"] += 1
        elif status is not None:
            odd(tid, f"{status} {exc}")
        elif ran[tid] or starts_of:
            odd(tid, "started, no result")
        else:
            lost.add(tid)
    odd_count = sum(n for k, n in counts.items() if k.startswith("unexplained"))
    return {"outcomes": dict(counts), "duplicates": dict(duplicates), "lost": sorted(lost),
            "unexplained": unexplained, "unexplained_count": odd_count}  # fmt: skip


def held_at_once(published: Sequence[Published], runs: Sequence[dict[str, Any]]
                 ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per worker, the most CPU the finished runs held at one instant, and the most
    runs of each limited queue.

    A run's interval (inside the task) lies within the time the worker holds its
    resources, so these can only be lower than what the worker held.  Runs killed
    mid-task have no finish and are not counted.
    """
    kinds = {p.id: p.spec.kind for p in published}
    events: dict[str, list[tuple[float, int, str, float]]] = {}
    for run in runs:
        demand = DEMANDS.get(kinds.get(run["id"], ""), DEMANDS["*"])["cpu"]
        points = events.setdefault(run["worker"], [])
        points += [(run["started"], 1, run["queue"], demand),
                   (run["finished"], -1, run["queue"], demand)]  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for worker, points in events.items():
        cpu = peak_cpu = 0.0
        per_queue: Counter[str] = Counter()
        most: dict[str, float] = dict.fromkeys(QUEUE_CONCURRENCY, 0)
        for _, step, queue, demand in sorted(points, key=lambda p: (p[0], p[1])):
            cpu += step * demand
            per_queue[queue] += step
            peak_cpu = max(peak_cpu, cpu)
            if queue in most:
                most[queue] = max(most[queue], per_queue[queue])
        out[worker] = {"cpu": peak_cpu, **most}
    return out


def resource_books(control: Any, nodes: Sequence[str], workers: Sequence[WorkerProcess],
          timeout: float) -> dict[str, Any]:  # fmt: skip
    """Each worker's ``resources`` from ``inspect fair_stats``, asked until every worker
    holds nothing and runs nothing (its books repaired after the churn) or ``timeout``."""
    return _settled_books(
        control, nodes, workers, timeout, "resources",
        lambda r: r["running"] == 0 and not any(r["held"].values()),
    )  # fmt: skip


def key_token_books(control: Any, nodes: Sequence[str], workers: Sequence[WorkerProcess],
                    timeout: float) -> dict[str, Any]:  # fmt: skip
    """Each worker's ``key_tokens`` (RabbitMQ's per-key limits) from ``inspect fair_stats``,
    asked until every worker holds no token and has no task aside, or ``timeout``."""
    return _settled_books(
        control, nodes, workers, timeout, "key_tokens",
        lambda t: t["held"] == 0 and t["aside"] == 0,
    )  # fmt: skip


def _settled_books(control: Any, nodes: Sequence[str], workers: Sequence[WorkerProcess],
                   timeout: float, part: str,
                   settled: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:  # fmt: skip
    """Each worker's ``part`` of ``inspect fair_stats``, asked until ``settled`` holds for
    every worker's or ``timeout``: ``{"settled": ok, "workers": {node: part}}``."""
    last: dict[str, Any] = {}

    def all_settled() -> bool:
        replies = (
            control.control.inspect(timeout=2.0, destination=list(nodes))._request("fair_stats")
            or {}
        )
        for node, reply in replies.items():
            last[node] = (reply or {}).get(part)
        return all((books := last.get(n)) is not None and settled(books) for n in nodes)

    ok = _wait(all_settled, workers, timeout, every=1.0)
    return {"settled": ok, "workers": last}


def wave_shares(published: Sequence[Published], starts: Sequence[dict[str, Any]],
                waves: int) -> dict[str, Any]:  # fmt: skip
    """hi:lo over each wave while both were backlogged, and over every wave together.

    Starts (first start of each task; countdown tasks left out: a worker holds
    them until their ETA) from the ``WARMUP``-th of the wave until ``TAIL``
    starts before the moment the first of hi and lo had started all but its
    last ``TAIL`` tasks. Not its very last: a few tasks a worker held while its
    pool processes were replaced start seconds after the rest of their queue,
    and would stretch the window over the time the other queue ran alone.
    """
    first: dict[str, float] = {}
    for s in starts:
        first[s["id"]] = min(first.get(s["id"], s["started"]), s["started"])
    per_wave = []
    total: Counter[str] = Counter()
    for w in range(waves):
        rows = sorted(
            (first[p.id], p.spec.queue) for p in published
            if p.wave == w and p.spec.kind != "countdown" and p.id in first
        )  # fmt: skip
        by_queue = {queue: [t for t, q in rows if q == queue] for queue in WEIGHTS}
        dry = min(times[-min(TAIL, len(times))] if times else 0.0 for times in by_queue.values())
        window = [q for t, q in rows if t < dry][WARMUP:-TAIL] if rows else []
        counts = Counter(q for q in window if q in WEIGHTS)
        total.update(counts)
        per_wave.append({"counts": dict(counts), "ratio": _ratio(counts)})
    return {"waves": per_wave, "counts": dict(total), "ratio": _ratio(total)}


def _ratio(counts: Counter[str]) -> float | None:
    return counts["hi"] / counts["lo"] if counts["lo"] else None


def log_lines(log: str) -> dict[str, Any]:
    """What a worker's log says: stalls, UP timeouts, the churn's errors and any other.

    A traceback belongs to the log record before it: it is unexpected only when
    that record is.
    """
    bad: list[str] = []
    record = ""
    for line in log.splitlines():
        if line.startswith("["):
            record = line
            if any(b in line for b in ("CRITICAL/", "ERROR/")) and not _expected(line):
                bad.append(line)
        elif line.startswith("Traceback") and not _expected(record):
            bad.append(f"{line} (after: {record[:200]})")
    lines = log.splitlines()
    return {
        "stalls": sum(STALL in line for line in lines),
        "stall_lines": [line for line in lines if STALL in line][:10],
        "up_timeouts": sum(UP_TIMEOUT in line for line in lines),
        "time_limit_lines": sum("Hard time limit" in line for line in lines),
        "killed_lines": sum("exited with 'signal 9 (SIGKILL)'" in line for line in lines),
        "worker_lost_lines": sum("raised error: WorkerLostError" in line for line in lines),
        "scaling_up": sum("Scaling up" in line for line in lines),
        "scaling_down": sum("Scaling down" in line for line in lines),
        "celery_fair_warnings": sum("WARNING/" in ln and "celery-fair" in ln for ln in lines),
        "other_errors": len(bad),
        "other_error_lines": bad[:10],
    }


_TASK_LINE = re.compile(r"\[\S+ \S+: \w+/\S+\] Task \S+\[([0-9a-f-]+)\] (received|succeeded)")


def task_times(log: str) -> dict[str, tuple[float, float]]:
    """``task id -> (received, succeeded)`` for each task a worker's log shows both for."""
    seen: dict[str, dict[str, float]] = {"received": {}, "succeeded": {}}
    for line in log.splitlines():
        if (m := _TASK_LINE.match(line)) and (at := _stamp(line)) is not None:
            seen[m.group(2)].setdefault(m.group(1), at)
    done = seen["succeeded"]
    return {t: (at, done[t]) for t, at in seen["received"].items() if t in done}


def task_waits(log: str) -> list[float]:
    """Seconds from "received" to "succeeded" of each task a worker's log shows both for."""
    return [done - at for at, done in task_times(log).values()]


_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): ")


def _stamp(line: str) -> float | None:
    """The epoch seconds a Celery log record is stamped with (local time), or None."""
    if m := _STAMP.match(line):
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def log_times(log: str, needle: str) -> list[float]:
    """When ``log``'s records containing ``needle`` were stamped."""
    return [t for line in log.splitlines() if needle in line and (t := _stamp(line)) is not None]


def log_around(log: str, at: float, before: float = 2.0, after: float = 0.5,
               most: int = 40) -> list[str]:  # fmt: skip
    """The log records of ``log`` stamped in ``[at - before, at + after]`` (epoch seconds).

    Lines without a stamp (tracebacks) go with the record before them; a task's
    "received" and "succeeded" records are left out.  For an unexplained outcome,
    the worker's own account of what happened around it.
    """
    kept: list[str] = []
    inside = False
    for line in log.splitlines():
        if (stamp := _stamp(line)) is not None:
            chatter = line.endswith("] received") or "] succeeded in " in line
            inside = at - before <= stamp <= at + after and not chatter
        if inside:
            kept.append(line[:300])
    return kept[-most:]


def _expected(line: str) -> bool:
    return any(e in line for e in EXPECTED_ERRORS)


# -- the run ------------------------------------------------------------------------


@contextlib.contextmanager
def _servers(kind: str, redis_server: RedisServer | None, rabbitmq_server: Any) -> Iterator[
    tuple[str, str, str, Any]
]:  # fmt: skip
    """``(broker, backend, ledger, rabbitmq)`` URLs, starting the servers not given.

    A given Redis: the broker in db 0 (Redis), the results in db 1, the ledger in db 2.
    """
    with contextlib.ExitStack() as stack:
        if redis_server is None:
            redis_server = stack.enter_context(RedisServer())
        base = redis_server.url.rsplit("/", 1)[0]
        if kind == "redis":
            yield f"{base}/0", f"{base}/1", f"{base}/2", None
            return
        if rabbitmq_server is None:
            from tests.harness.rabbitmq import RabbitMQServer

            rabbitmq_server = stack.enter_context(RabbitMQServer())
        yield rabbitmq_server.url, f"{base}/1", f"{base}/2", rabbitmq_server


def _node(worker: WorkerProcess) -> str:
    return f"{worker.name}@{socket.gethostname()}"


def _alive(workers: Iterable[WorkerProcess]) -> None:
    for w in workers:
        if w.proc is None or w.proc.poll() is not None:
            raise RuntimeError(f"{w.name} exited early:\n{w.log()[-4000:]}")


def _wait(check: Callable[[], bool], workers: Sequence[WorkerProcess], timeout: float,
          every: float = 0.2) -> bool:  # fmt: skip
    """Poll ``check`` until it holds (True) or ``timeout`` s pass (False).

    Fails if a worker exits."""
    deadline = time.monotonic() + timeout
    while not check():
        _alive(workers)
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _drain(queues: Broker, workers: Sequence[WorkerProcess], started: Callable[[], int],
           quiet: float, deadline: float, report: Callable[[], None]) -> bool:  # fmt: skip
    """Wait until nothing waits on the broker (every task fetched), reporting every 10 s.

    False when no task started for ``quiet`` s with tasks waiting (the workers stalled),
    or at the deadline.
    """
    last = moved = time.monotonic()
    count = started()
    while queues.waiting() != 0:
        _alive(workers)
        now = time.monotonic()
        if now > deadline:
            return False
        if started() != count:
            count, moved = started(), now
        elif now - moved > quiet:
            return False
        if now - last > 10:
            last = now
            report()
        time.sleep(0.5)
    return True


def _settle(backend: str, pending: set[str], workers: Sequence[WorkerProcess], quiet: float,
            deadline: float) -> set[str]:  # fmt: skip
    """Wait until every task has a result stored, or none has for ``quiet`` s: what is left."""
    moved = time.monotonic()
    while pending:
        _alive(workers)
        done = {t for t, o in outcomes(backend, pending).items() if o.status in TERMINAL}
        if done:
            pending = pending - done
            moved = time.monotonic()
        elif time.monotonic() - moved > quiet or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return pending


def run_churn(
    broker: str,
    tasks: int,
    fair: bool,
    *,
    waves: int = 4,
    max_tasks_per_child: int = 100,
    kill_every: float = 2.0,
    revoke_every: float = 2.0,
    slow_share: float = 0.003,
    over_share: float = 0.002,
    countdown_share: float = 0.02,
    tenants: int = 8,
    quiet: float = 20.0,
    timeout: float | None = None,
    seed: int = 49,
    resources: bool = False,
    key_concurrency: int | None = None,
    priorities: bool = False,
    redis_server: RedisServer | None = None,
    rabbitmq_server: Any = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one churn soak on ``broker`` ("redis" or "rabbitmq") and return its record.

    ``fair``: celery-fair (``celery_fair.install``), else plain Celery with the same
    settings and flags.  Servers not given are started (and stopped) here; a given
    Redis lends databases 0 (the broker), 1 (results) and 2 (the ledger): the
    ledger's keys are deleted first.  ``quiet``: seconds with no task newly
    accounted for after which the rest counts as lost.  ``timeout``: the whole run.
    ``resources``: the workers have a capacity, ``lo`` a concurrency limit and the cost
    is DRF's, and every task declares what it holds (:data:`CAPACITY`).
    ``key_concurrency``: every key of the keyed queue limited to that many at once
    (``fair_key_concurrency = {"*": n}``); the record's ``key_limits`` says what the
    workers held after the churn and the most of a key that ran at once.
    ``priorities``: tasks with priorities in weighted levels (:data:`PRIORITIES`).
    """
    if broker not in ("redis", "rabbitmq"):
        raise ValueError(f"broker must be redis or rabbitmq, not {broker!r}")
    from tests.integration.production_app import make_app

    timeout = timeout if timeout is not None else 300.0 + tasks / 40
    deadline = time.monotonic() + timeout
    rng = random.Random(seed)
    queues = [*WEIGHTS, KEYED]
    specs = plan(tasks, waves, rng, queues=queues, tenants=tenants, slow=slow_share,
                 over=over_share, countdown=countdown_share)  # fmt: skip
    began = time.time()
    with _servers(broker, redis_server, rabbitmq_server) as (url, backend, ledger_url, rabbit):
        ledger = redis_lib.Redis.from_url(ledger_url)
        ledger.delete("ledger", "ledger:starts", "ledger:queues", "ledger:recorded")
        # On RabbitMQ a keyed queue's tasks wait in its lanes, declared by celery-fair.
        levelled = frozenset((KEYED,)) if priorities else frozenset()
        lanes = (
            KeyLanes(frozenset((KEYED,)), levelled).lanes(KEYED)
            if broker != "redis" and fair
            else ()
        )
        queue_state = Broker(broker, url, [*queues, *lanes], rabbit)
        queue_state.purge()
        env = {
            "CELERY_FAIR_BROKER": url,
            "CELERY_FAIR": "1" if fair else "0",
            "PRODUCTION_BACKEND": backend,
            "PRODUCTION_LEDGER": ledger_url,
            "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in WEIGHTS.items()),
        }
        if resources:
            env["PRODUCTION_CAPACITY"] = ",".join(f"{r}={n:g}" for r, n in CAPACITY.items())
            env["PRODUCTION_QUEUE_CONCURRENCY"] = ",".join(
                f"{q}={n}" for q, n in QUEUE_CONCURRENCY.items()
            )
            env["PRODUCTION_COST"] = "dominant"
        env["PRODUCTION_KEYS"] = f"{KEYED}=tenant_id"
        env["PRODUCTION_KEY_MAX_BACKLOG"] = f"*={BACKLOG_CAP}"
        if key_concurrency is not None:
            env["PRODUCTION_KEY_CONCURRENCY"] = f"*={key_concurrency}"
        if priorities:
            env["PRODUCTION_MAX_PRIORITY"] = str(MAX_PRIORITY)
            env["PRODUCTION_PRIORITY"] = "weighted"
        if broker == "redis":
            env["PRODUCTION_VISIBILITY"] = str(VISIBILITY)
        # The producer stores no results: Celery's Redis backend would subscribe
        # to every task's result channel.  The workers store them (db 1).
        producer = make_app({**env, "PRODUCTION_BACKEND": ""}, name="churn-producer")
        control = make_app({**env, "PRODUCTION_BACKEND": ""}, name="churn-control")
        limit = f"--time-limit={WORKER_TIME_LIMIT}"
        b = WorkerProcess(
            url, queues, concurrency=2, fair=fair, app=APP, env=env,
            name=f"churnb-{uuid.uuid4().hex[:6]}",
            extra_args=[*FLAGS, limit, f"--max-tasks-per-child={max_tasks_per_child}"],
        )  # fmt: skip
        a = WorkerProcess(
            url, queues, concurrency=3, fair=fair, app=APP, name=f"churna-{uuid.uuid4().hex[:6]}",
            env={**env, "AUTOSCALE_KEEPALIVE": str(KEEPALIVE)},  # see KEEPALIVE
            extra_args=[*FLAGS, limit, "--autoscale=3,1"],
        )  # fmt: skip
        workers = [b, a]
        churn = Churn({_node(w): w for w in workers}, control, ledger, kill_every,
                      revoke_every, random.Random(seed + 1))  # fmt: skip
        published = churn.published
        record: dict[str, Any] = {}
        exits: dict[str, int | None] = {}
        try:
            for w in workers:
                w.start()
            ok = _wait(lambda: all(f"{_node(w)} ready." in w.log() for w in workers), workers, 90)
            if not ok:
                raise RuntimeError(
                    "workers not ready:\n" + "\n".join(w.log()[-3000:] for w in workers)
                )
            progress(f"{broker} {'celery-fair' if fair else 'plain'}: workers ready, "
                     f"{tasks} tasks in {waves} waves")  # fmt: skip
            churn.start()
            stalled = 0  # the wave after which nothing started any more

            def started() -> int:
                return int(ledger.llen("ledger:starts"))  # type: ignore[arg-type]

            def report(i: int) -> None:
                progress(
                    f"  wave {i + 1}/{waves}: {len(published)} published, {started()} started, "
                    f"{len(churn.kills)} kills, {len(churn.revokes)} revokes"
                )

            t_waves = time.monotonic()
            for i, wave in enumerate(specs):
                shrinks = log_lines(a.log())["scaling_down"]
                publish(producer, wave, i, rng, published.append, resources, priorities)
                drained = _drain(queue_state, workers, started, quiet, deadline,
                                 lambda i=i: report(i))  # fmt: skip
                if not drained:
                    stalled = i + 1
                    progress(f"  wave {i + 1}: nothing started for {quiet:g} s: stalled")
                    break
                if i < waves - 1:  # the pause: worker a shrinks
                    _wait(lambda n=shrinks: log_lines(a.log())["scaling_down"] > n,
                          workers, KEEPALIVE + 12)  # fmt: skip
            waves_s = time.monotonic() - t_waves
            pending = _settle(backend, {p.id for p in published}, workers, quiet, deadline)
            accounted_s = time.monotonic() - t_waves
            churn.join()
            # While the workers still run: nothing waits, nothing is held (an ack may lag).
            first_left = queue_state.left()
            left_running = dict(first_left)

            def empty() -> bool:
                left_running.update(queue_state.left())
                return not any(left_running.values())

            _wait(empty, workers, 15, every=0.5)
            # Every keyed task received freed its place (RabbitMQ's counters).
            counters = [
                KeyLanes.backlog_counter(KEYED, f"t{i}", BACKLOG_CAP) for i in range(tenants)
            ]
            markers = {"left": queue_state.markers(counters)}

            def freed() -> bool:
                markers["left"] = queue_state.markers(counters)
                return markers["left"] is None or markers["left"][1] == 0

            if fair:
                _wait(freed, workers, 15, every=0.5)
            held = (
                None if not resources
                else resource_books(control, [_node(w) for w in workers], workers, 30) if fair
                else {"settled": None, "workers": {}}  # plain Celery keeps no such books
            )  # fmt: skip
            tokens = (
                key_token_books(control, [_node(w) for w in workers], workers, 30)
                if fair and key_concurrency is not None and broker == "rabbitmq"
                else None
            )
            where = queue_state.locate(pending)
            for w in workers:
                exits[w.name] = w.stop(timeout=60)
            left_stopped = queue_state.left()
            starts = [json.loads(r) for r in ledger.lrange("ledger:starts", 0, -1)]  # type: ignore[union-attr]
            runs = [json.loads(r) for r in ledger.lrange("ledger", 0, -1)]  # type: ignore[union-attr]
            results = outcomes(backend, [p.id for p in published])
            revoked = {r["id"] for r in churn.revokes}
            texts = {"b": b.log(), "a": a.log()}  # each worker's log, read once
            shrinks = {
                _node(w): log_times(texts[n], "Scaling down") for n, w in (("b", b), ("a", a))
            }
            books = account(published, starts, runs, results, churn.kills, revoked, shrinks)
            outcomes_ = Counter(books["outcomes"])
            logs = {n: log_lines(text) for n, text in texts.items()}
            for example in books["unexplained"][:5]:
                outcome, begun = example["result"], example["starts"]
                at = outcome.done if outcome else begun[-1]["started"] if begun else None
                if at is not None:
                    example["log"] = {n: log_around(text, at) for n, text in texts.items()}
            pids = {
                name: sorted({s["pid"] for s in starts if s["worker"] == _node(w)})
                for name, w in (("b", b), ("a", a))
            }
            per_child_b = Counter(s["pid"] for s in starts if s["worker"] == _node(b))
            seen = {name: len(churn.seen.get(_node(w), set())) for name, w in (("b", b), ("a", a))}
            record = {
                "broker": broker,
                "variant": "celery-fair" if fair else "plain",
                "tasks": len(published),
                "kinds": dict(Counter(p.spec.kind for p in published)),
                "queues": dict(Counter(p.spec.queue for p in published)),
                "priorities": list(PRIORITIES) if priorities else None,
                "starts": len(starts),
                "runs": len(runs),
                "lost": len(books["lost"]),
                "lost_where": {k: len(v) for k, v in where.items()},
                "lost_ids": books["lost"][:20],
                "outcomes": books["outcomes"],
                "duplicates": books["duplicates"],
                "unexplained": books["unexplained_count"],
                "unexplained_examples": books["unexplained"],
                "kills": len(churn.kills),
                "kill_log": churn.kills,
                "revoke_log": churn.revokes,
                # Tasks over a time limit, and tasks whose process the churn killed.
                "time_limits": outcomes_["time limit"]
                - outcomes_[KILLED_AS_STARTED]
                - outcomes_["revoked while running, ended by its time limit"],
                "killed_tasks": outcomes_["killed (WorkerLostError)"]
                + outcomes_[KILLED_AS_STARTED],
                "revokes": len(churn.revokes),
                "revokes_running": sum(r["running"] for r in churn.revokes),
                "revoked": books["outcomes"].get("revoked", 0),
                "pool_pids_ran": {k: len(v) for k, v in pids.items()},
                "pool_pids_seen": seen,
                # Processes beyond the most a worker has at once (b 2, a 3).
                "child_replacements": max(0, len(pids["b"]) - 2) + max(0, len(pids["a"]) - 3),
                "runs_per_child_b_max": max(per_child_b.values(), default=0),
                "shares": wave_shares(published, starts, waves),
                "stalls": logs["b"]["stalls"] + logs["a"]["stalls"],
                "stalled_in_wave": stalled,
                "up_timeouts": logs["b"]["up_timeouts"] + logs["a"]["up_timeouts"],
                "logs": logs,
                "left_running_first": first_left,
                "left_running": left_running,
                "left_after_stop": left_stopped,
                "backlog_markers": markers["left"],
                # resources=True: what each worker's books say after the churn, and the
                # most held at once per worker from the finished runs.
                "resources": None
                if held is None
                else {
                    **held,
                    "at_once": held_at_once(published, runs),
                },
                "key_limits": None
                if key_concurrency is None
                else {
                    "limit": key_concurrency,
                    "most_at_once": most_at_once(
                        SimpleNamespace(**r)
                        for r in runs
                        if r["queue"] == KEYED or str(r["queue"]).startswith(KEYED + ".fair.")
                    ),
                    "tokens": tokens,
                },  # fmt: skip
                "exit_codes": exits,
                "churn_errors": churn.errors[:10],
                "waves_seconds": waves_s,
                "accounted_seconds": accounted_s,
                "params": {
                    "waves": waves,
                    "max_tasks_per_child": max_tasks_per_child,
                    "kill_every": kill_every,
                    "revoke_every": revoke_every,
                    "slow_share": slow_share,
                    "over_share": over_share,
                    "countdown_share": countdown_share,
                    "tenants": tenants,
                    "quiet": quiet,
                    "ms": MS,
                    "slow_ms": SLOW_MS,
                    "over_ms": OVER_MS,
                    "worker_time_limit": WORKER_TIME_LIMIT,
                    "task_time_limit": TASK_TIME_LIMIT,
                    "weights": WEIGHTS,
                    "keyed": KEYED if broker == "redis" else None,
                    "visibility_timeout": VISIBILITY if broker == "redis" else None,
                    "autoscale_keepalive": KEEPALIVE,
                    "seed": seed,
                    "resources": {
                        "capacity": CAPACITY,
                        "queue_concurrency": QUEUE_CONCURRENCY,
                        "demands": DEMANDS,
                        "cost": "dominant",
                    }
                    if resources
                    else None,
                },  # fmt: skip
            }
        finally:
            churn.join()
            for w in workers:
                w.stop(timeout=60)
            producer.close()
            control.close()
            with contextlib.suppress(Exception):
                queue_state.purge()
            with contextlib.suppress(Exception):
                ledger.delete("ledger", "ledger:starts", "ledger:queues", "ledger:recorded")
            with contextlib.suppress(Exception):
                client = redis_lib.Redis.from_url(backend)
                ids = [f"celery-task-meta-{p.id}" for p in published]
                for start in range(0, len(ids), 5000):
                    client.delete(*ids[start : start + 5000])
            for w in workers:
                if w.log_path is not None:
                    record.setdefault("log_files", {})[w.name] = str(w.log_path)
    record["wall_seconds"] = time.time() - began
    return record
