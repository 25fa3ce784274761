"""The commands and settings deployments run, on both brokers and every pool.

Workers start with Celery's defaults (mingle, gossip, heartbeat) plus what
deployments add: ``-E``, ``-O fair``, ``task_acks_late`` with
``worker_prefetch_multiplier = 1``, a Redis result backend, a
``visibility_timeout`` on Redis, ``--autoscale``, ``--max-tasks-per-child``,
``-B`` and ``celery multi``.  The app is :mod:`tests.integration.production_app`;
every task run is recorded in a Redis list (the ledger).

Each run checks together: no worker exits early or logs CRITICAL (or a
traceback, or an ERROR line), the weights hold while every measured queue is
backlogged, every task runs exactly once (a task caught running by a warm
shutdown may run again: Celery's own late-ack behaviour, see
:func:`assert_ran_once`), its result is in the result backend, nothing is
left on the broker, and every warm shutdown exits 0.

Cost (about 3 minutes): one worker run per broker x pool, the core (countdown,
retry, chord, events, shares, results), at a few hundred 2 ms tasks.  The
scenarios that need more workers run on one pool, prefork: the pool
deployments run by default and the only one that implements ``--autoscale``
and ``--max-tasks-per-child``.  They are two workers started together, one of
them then restarted (mingle finds its neighbour, gossip, ``--autoscale``,
``--max-tasks-per-child``, ``-B``) on both brokers, and ``celery multi`` with a
keyed queue on Redis.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import celery
import pytest
import redis as redis_lib
from celery import Celery, chord
from celery.result import AsyncResult, ResultSet

from celery_fair.keys.layout import KeyedNames
from tests.harness.brokers import broker_for
from tests.harness.churn import by_shrink, log_around, log_times, outcomes
from tests.harness.harness import WorkerProcess, run_backlogged
from tests.integration.production_app import make_app

pytestmark = [pytest.mark.integration, pytest.mark.compat]

APP = "tests.integration.production_app"
ROOT = Path(__file__).resolve().parents[2]
POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
BROKERS = (pytest.param("redis"), pytest.param("rabbitmq", marks=pytest.mark.rabbitmq))
#: The deployment flags every worker here starts with (besides Celery's defaults).
FLAGS = ("-E", "-O", "fair")
#: Weighted queues (``fair_weights``) and the queue of the other tasks (weight 1).
WEIGHTS = {"pa": 1, "pb": 3}
EXTRA = "px"
#: Milliseconds each weighted task sleeps: the pool, not the broker, is the
#: bottleneck, so tasks wait for a slot and the scheduler decides the order.
MS = 2
#: Redis ``visibility_timeout``: far longer than any task, countdown or retry
#: here, so a redelivery would be a bug, not the timeout.
VISIBILITY = 300
#: Celery before 5.7 with -P threads: some task events of the pool's threads
#: are lost (the event dispatcher was not thread-safe, celery/celery#10434),
#: and tasks run slowly (see test_a_production_worker).  Plain Celery too.
OLD_THREADS = celery.VERSION < (5, 7)
#: Ledger entries skipped before a share is measured: the start, when every
#: prefetch window fills at once.
WARMUP = 20


# -- the stack: broker, result backend and ledger ------------------------------


@dataclass
class Stack:
    """A broker, and the Redis that keeps the results (db 1) and the ledger (db 0)."""

    kind: str
    broker: str
    redis: str  # the ledger's URL (db 0, emptied after each test by ``redis_url``)

    @property
    def backend(self) -> str:
        return self.redis.rsplit("/", 1)[0] + "/1"

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "CELERY_FAIR_BROKER": self.broker,
            "PRODUCTION_BACKEND": self.backend,
            "PRODUCTION_LEDGER": self.redis,
            "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in WEIGHTS.items()),
        }
        if self.kind == "redis":
            env["PRODUCTION_VISIBILITY"] = str(VISIBILITY)
        env.update(extra)
        return env

    def ledger(self) -> list[dict[str, Any]]:
        client = redis_lib.Redis.from_url(self.redis)
        return [json.loads(raw) for raw in client.lrange("ledger", 0, -1)]

    def ledger_count(self, queues: Sequence[str] = ()) -> int:
        """Runs recorded so far (of ``queues`` only, if given)."""
        client = redis_lib.Redis.from_url(self.redis)
        if not queues:
            return int(client.llen("ledger"))
        return sum(int(n or 0) for n in client.hmget("ledger:queues", list(queues)))


@pytest.fixture
def stack(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Stack]:
    kind = request.param
    broker = redis_url if kind == "redis" else request.getfixturevalue("rabbitmq_server").url
    stack = Stack(kind, broker, redis_url)
    if kind == "rabbitmq":
        _empty_amqp_queues(broker)
    yield stack
    redis_lib.Redis.from_url(stack.backend).flushdb()
    if kind == "rabbitmq":
        _empty_amqp_queues(broker)


def _empty_amqp_queues(url: str) -> None:
    """Declare the queues as a worker does, and empty them.

    Emptied, not deleted: Kombu's connection pools are shared by every app of
    a process and remember what they declared, so a producer would not declare
    a deleted queue again, and its messages would be dropped.
    """
    from kombu import Connection

    app = Celery("production-queues", broker=url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    with Connection(url) as conn:
        channel = conn.channel()
        for name in (*WEIGHTS, EXTRA):
            app.amqp.queues[name](channel).declare()
            channel.queue_purge(name)
    app.close()


@pytest.fixture
def producer(stack: Stack) -> Iterator[Celery]:
    """The project's app in the test process: it publishes and reads the results."""
    app = make_app(stack.env(), name="production-producer")
    # A result the test still holds at the end of the session (a failed test's
    # traceback) unsubscribes when collected: one try, not 20 s of reconnects
    # to the stopped server.
    app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
    yield app
    gc.collect()  # the results (chords hold cycles) unsubscribe while the server runs
    app.close()


# -- waiting and checking -------------------------------------------------------


def _alive(workers: Iterable[WorkerProcess]) -> None:
    for w in workers:
        code = None if w.proc is None else w.proc.poll()
        assert w.proc is not None and code is None, (
            f"{w.name} exited early ({code}):\n{w.log()[-4000:]}"
        )


def wait_until(
    check: Callable[[], bool],
    what: str | Callable[[], str],
    workers: Sequence[WorkerProcess],
    timeout: float = 120.0,
) -> None:
    """Poll ``check`` until it holds; fail if a worker exits or at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        _alive(workers)
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name}\n{w.log()[-3000:]}" for w in workers)
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out waiting for {said}\n{logs}")
        time.sleep(0.02)


#: Lines no healthy run logs.
BAD_LINES = ("CRITICAL", "Traceback", "Unrecoverable error", "ERROR/")


def assert_clean(log: str, name: str) -> None:
    bad = [line for line in log.splitlines() if any(b in line for b in BAD_LINES)]
    assert not bad, f"{name} logged:\n" + "\n".join(bad[:20]) + f"\n{log[-4000:]}"


@contextlib.contextmanager
def running(*workers: WorkerProcess) -> Iterator[None]:
    """Start the workers; on the way out, stop any still running (a failed test)."""
    try:
        for w in workers:
            w.start()
        yield
    finally:
        for w in workers:
            w.stop(timeout=60)


@dataclass(frozen=True)
class Shutdown:
    """A warm shutdown: the worker's node name, when it was asked to stop and when it exited."""

    node: str
    began: float
    exited: float

    def caught(self, run: dict[str, Any]) -> bool:
        """Whether ``run`` was in flight when this shutdown began.

        One second of margin: a late ack is sent on the event loop's next turn.
        """
        return (
            run["worker"] == self.node
            and run["started"] <= self.exited
            and run["finished"] >= self.began - 1.0
        )


def _node(worker: WorkerProcess) -> str:
    """The node name ``-n name@%h`` gives the worker."""
    return f"{worker.name}@{socket.gethostname()}"


def stop_cleanly(worker: WorkerProcess, node: str | None = None) -> Shutdown:
    """Warm shutdown; the exit status must be 0 and the log clean."""
    began = time.time()
    code = worker.stop(timeout=60)
    exited = time.time()
    log = worker.log()
    assert code == 0, f"{worker.name}: warm shutdown exited {code}\n{log[-4000:]}"
    assert_clean(log, worker.name)
    return Shutdown(node or worker.name, began, exited)


def measure_window(
    stack: Stack, queues: Sequence[str], n: int, workers: Sequence[WorkerProcess]
) -> None:
    """Wait until ``WARMUP + n`` runs of ``queues`` are recorded, then check they were backlogged.

    Every task of ``queues`` is published before the workers start, so a
    queue's length only falls: when it is still above 0 after the runs were
    counted, every run of the measured window started while all the queues
    had messages waiting.
    """
    wait_until(
        lambda: stack.ledger_count(queues) >= WARMUP + n, f"{WARMUP + n} runs of {queues}", workers
    )
    lengths = broker_for(stack.broker).lengths(queues)
    assert all(lengths[q] > 0 for q in queues), f"a queue ran dry mid-window: {lengths}"


def window_shares(entries: list[dict[str, Any]], field_: str, n: int) -> dict[str, float]:
    """Shares by ``field_`` of runs ``WARMUP`` .. ``WARMUP + n`` in start order."""
    window = sorted(entries, key=lambda e: e["started"])[WARMUP : WARMUP + n]
    assert len(window) == n
    counts = Counter(e[field_] for e in window)
    return {k: c / n for k, c in counts.items()}


def assert_weighted(shares: dict[str, float], runs: int, *logs: str) -> None:
    """``pb`` (weight 3) has 3/4 of the runs of ``pa`` and ``pb`` together.

    Tolerance: DRR keeps served/weight of two backlogged queues within two
    visits (docs/algorithms.md), a few runs of pb; start order differs from
    dispatch order by the tasks running at once at each end of the window (2
    to 5 here).  About 8 runs out of place, 0.06 of 160 or 200 runs, 0.08 of
    100.  Plain Celery gives 1/2.

    On RabbitMQ the windows a worker logged must be in the ratio of the
    weights: with late acks they alone bound each queue's share.
    """
    for windows in filter(None, map(_push_windows, logs)):
        assert windows["pb"] == 3 * windows["pa"], windows
    assert shares["pb"] == pytest.approx(0.75, abs=max(0.06, 8 / runs)), shares


def _push_windows(log: str) -> dict[str, int] | None:
    """The per-queue prefetch windows a worker logged at start (RabbitMQ)."""
    found = re.search(r"per-queue prefetch windows (\{[^}]*\})", log)
    return None if found is None else dict(ast.literal_eval(found.group(1)))


def _shrunk(stack: Stack, known: set[str], log: str) -> set[str]:
    """Tasks not in ``known`` whose result is a ``WorkerLostError`` of an autoscale
    shrink of the worker that wrote ``log`` (:func:`tests.harness.churn.by_shrink`:
    billiard SIGTERMs a process it counts idle as a job reaches it)."""
    client = redis_lib.Redis.from_url(stack.backend)
    prefix = "celery-task-meta-"
    ids = [
        k.decode().removeprefix(prefix) for k in client.scan_iter(match=prefix + "*", count=1000)
    ]
    shrinks = log_times(log, "Scaling down")
    return {
        tid for tid, outcome in outcomes(stack.backend, ids).items()
        if tid not in known and outcome.exc == "WorkerLostError"
        and by_shrink(outcome.message, outcome.done, shrinks)
    }  # fmt: skip


def assert_ran_once(
    entries: list[dict[str, Any]], published: Iterable[str], shutdowns: Sequence[Shutdown] = ()
) -> None:
    """Every published task ran, once per attempt, and nothing else ran.

    Except a task caught running by a warm shutdown: with late acks Celery
    does not send the ack of a task that finishes while its worker shuts down,
    and the broker delivers the task again (celery/celery#3802, #3796; plain
    Celery as well).  Every run of a task but its last must then have been
    caught by a shutdown of its worker.
    """
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in entries:
        runs.setdefault((e["id"], e["retries"]), []).append(e)

    def excused(rs: list[dict[str, Any]]) -> bool:
        earlier = sorted(rs, key=lambda r: r["started"])[:-1]
        return all(any(s.caught(r) for s in shutdowns) for r in earlier)

    again = [rs for rs in runs.values() if len(rs) > 1 and not excused(rs)]
    assert not again, "ran more than once:\n" + "\n".join(json.dumps(r) for rs in again for r in rs)
    expected = set(published)
    ran = {e["id"] for e in entries}
    assert ran == expected, (
        f"missing {sorted(expected - ran)[:10]} ({len(expected - ran)}), "
        f"unexpected {sorted(ran - expected)[:10]}"
    )


def _timestamp(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


# -- events (-E, gossip) ----------------------------------------------------------


@dataclass
class EventLog:
    """The broker's event stream, captured in a thread (what ``celery events`` sees)."""

    broker: str
    events: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.app = Celery("production-events", broker=self.broker, set_as_current=False)
        self._receiver: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.app.connection_for_read() as conn:
                self._receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
                self._ready.set()
                self._receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> EventLog:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(15)
        self.app.close()

    def of(self, kind: str) -> list[dict[str, Any]]:
        assert self.error is None, repr(self.error)
        return [e for e in list(self.events) if e.get("type") == kind]

    def hostname_of(self, worker: WorkerProcess) -> str | None:
        """The worker's node name, once one of its heartbeats was heard."""
        for e in self.of("worker-heartbeat"):
            if str(e.get("hostname", "")).startswith(f"{worker.name}@"):
                return str(e["hostname"])
        return None

    def task_ids(self, kind: str) -> set[str]:
        return {str(e.get("uuid")) for e in self.of(kind)}


# -- the core run: every broker x pool ---------------------------------------------

#: Tasks per weighted queue (``pa`` weighs 1, ``pb`` 3) and the measured window:
#: the queues are filled in the ratio of their weights, so both are still
#: backlogged when ``WARMUP + window`` runs are counted (asserted).
CORE = {"pa": 80, "pb": 240}
CORE_WINDOW = 160
#: The same for -P threads before Celery 5.7, where tasks run slowly.
SMALL_CORE = {"pa": 50, "pb": 150}
SMALL_WINDOW = 100


def _publish_weighted(producer: Celery, counts: dict[str, int]) -> dict[str, list[str]]:
    """``record(queue, MS)`` on each queue, positionally, as users call it."""
    record = producer.tasks["prod.record"]
    ids: dict[str, list[str]] = {q: [] for q in counts}
    with producer.producer_or_acquire() as conn:
        for queue, n in counts.items():
            for _ in range(n):
                ids[queue].append(record.apply_async((queue, MS), queue=queue, producer=conn).id)
    return ids


@dataclass
class Extras:
    """Countdowns, retries and a chord, published on ``EXTRA`` while the worker runs."""

    countdown: list[AsyncResult]
    flaky: list[AsyncResult]
    chord: AsyncResult
    header: list[AsyncResult]

    @property
    def ids(self) -> list[str]:
        results = [*self.countdown, *self.flaky, self.chord, *self.header]
        return [r.id for r in results]

    @property
    def runs(self) -> int:
        """Ledger entries they make: the flaky tasks run twice."""
        return len(self.countdown) + 2 * len(self.flaky) + 1 + len(self.header)


def _publish_extras(producer: Celery) -> Extras:
    record, flaky, total = (producer.tasks[n] for n in ("prod.record", "prod.flaky", "prod.total"))
    countdown = [record.apply_async((f"cd{i}",), countdown=1, queue=EXTRA) for i in range(3)]
    retried = [flaky.apply_async((f"fl{i}",), queue=EXTRA) for i in range(2)]
    body = chord([record.s(i).set(queue=EXTRA) for i in range(1, 5)])(total.s().set(queue=EXTRA))
    header = list(body.parent.results)  # type: ignore[union-attr]
    return Extras(countdown, retried, body, header)


def _check_extras(extras: Extras, entries: list[dict[str, Any]]) -> None:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_id.setdefault(e["id"], []).append(e)
    assert [r.get(timeout=30) for r in extras.countdown] == ["cd0", "cd1", "cd2"]
    for r in extras.countdown:
        (run,) = by_id[r.id]
        # Not before its ETA (a countdown ignored would start about 1 s early;
        # a timer may fire a fraction of a millisecond early).
        assert run["eta"] and run["started"] >= _timestamp(run["eta"]) - 0.05, run
    assert [r.get(timeout=30) for r in extras.flaky] == ["fl0", "fl1"]
    for r in extras.flaky:
        assert sorted(e["retries"] for e in by_id[r.id]) == [0, 1], by_id[r.id]
    assert [r.get(timeout=30) for r in extras.header] == [1, 2, 3, 4]
    assert extras.chord.get(timeout=30) == 10
    assert by_id[extras.chord.id][0]["value"] == [1, 2, 3, 4]


def _assert_results(producer: Celery, published: dict[str, list[str]]) -> None:
    """The backlog's results are in the result backend: each task returns its queue."""
    for queue, ids in published.items():
        results = ResultSet([producer.AsyncResult(i) for i in ids])
        assert results.get(timeout=30) == [queue] * len(ids)


def _assert_nothing_left(stack: Stack, queues: list[str]) -> None:
    """Nothing waits on the broker, nothing is unacknowledged (every late ack sent)."""
    assert broker_for(stack.broker).lengths(queues) == dict.fromkeys(queues, 0)
    if stack.kind == "redis":
        assert redis_lib.Redis.from_url(stack.broker).hlen("unacked") == 0


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("stack", BROKERS, indirect=True)
def test_a_production_worker(stack: Stack, producer: Celery, pool: str) -> None:
    env = stack.env()
    counts, window = CORE, CORE_WINDOW
    if pool == "threads" and OLD_THREADS:
        # Celery before 5.7, plain as well: on RabbitMQ the threads pool acks
        # slowly (about 8 tasks/s, celery/celery#6941); on Redis, with late
        # acks and one task per slot, its loop fetches again only when its 2 s
        # drain times out (about 2 tasks/s; celery/celery#4378, #7718): early
        # acks there.
        counts, window = SMALL_CORE, SMALL_WINDOW
        if stack.kind == "redis":
            env["PRODUCTION_ACKS_LATE"] = "0"
    published = _publish_weighted(producer, counts)
    worker = WorkerProcess(
        stack.broker, [*WEIGHTS, EXTRA], pool=pool, concurrency=2, app=APP, env=env,
        extra_args=FLAGS,
    )  # fmt: skip
    with EventLog(stack.broker) as events, running(worker):
        measure_window(stack, list(WEIGHTS), window, [worker])
        wait_until(lambda: events.hostname_of(worker) is not None, "a heartbeat", [worker])
        nodename = events.hostname_of(worker)
        # Published once the event stream is heard, so every task event must arrive.
        extras = _publish_extras(producer)
        total = sum(counts.values()) + extras.runs
        wait_until(lambda: stack.ledger_count() >= total, f"{total} runs", [worker])
        if pool == "threads" and OLD_THREADS:
            # Some of the pool threads' events are lost, plain Celery's too: -E
            # is on once a task event arrives.
            wait_until(
                lambda: bool(set(extras.ids) & events.task_ids("task-received")),
                "a task-received event (-E)", [worker],
            )  # fmt: skip
        else:
            wait_until(
                lambda: set(extras.ids) <= events.task_ids("task-succeeded"),
                lambda: (
                    "a task-succeeded event (-E) for every task published after start; "
                    f"missing {set(extras.ids) - events.task_ids('task-succeeded')}, heard "
                    f"{Counter(str(e.get('type')) for e in events.events)}"
                ),
                [worker],
            )
            assert {r.id for r in extras.flaky} <= events.task_ids("task-retried")
        if stack.kind == "redis":
            # celery_fair.install() kept the user's transport options.
            conf = producer.control.inspect(destination=[nodename], timeout=10).conf()
            options = conf[nodename]["broker_transport_options"]
            assert options["visibility_timeout"] == VISIBILITY, options
        shutdown = stop_cleanly(worker, nodename)
    entries = stack.ledger()
    assert len(entries) == total
    assert_ran_once(entries, [*published["pa"], *published["pb"], *extras.ids], [shutdown])
    weighted = [e for e in entries if e["queue"] in WEIGHTS]
    assert_weighted(window_shares(weighted, "queue", window), window, worker.log())
    # Results: in the result backend, for the backlog and for the others.
    _assert_results(producer, published)
    _check_extras(extras, entries)
    _assert_nothing_left(stack, [*WEIGHTS, EXTRA])


@pytest.mark.rabbitmq
def test_windows_of_a_worker_with_a_window_of_one_keep_the_weights(rabbitmq_server: Any) -> None:
    # Celery's window is one task (worker_prefetch_multiplier = 1 and one
    # process: -P solo, or --autoscale starting from one, as in the two-worker
    # test).  With late acks a queue's window bounds how many of its tasks the
    # worker holds, so the windows must be in the ratio of the weights: 2 and 4
    # give 2/3, not 3/4.  (Early acks: 3/4, the broker refills a window as soon
    # as a task is received.)  40 + 400 fetched tasks: DRR and the windows at
    # each end of the interval are within 0.03.
    result = run_backlogged(
        rabbitmq_server.url, {"la": 500, "lb": 1000}, target=400, warmup=40, pool="solo",
        concurrency=1, task="nap", args=(2,), extra_args=["--fair-weights", "la=1,lb=3"],
        env={"CELERY_FAIR_ACKS_LATE": "1", "CELERY_FAIR_PREFETCH_MULTIPLIER": "1"},
    )  # fmt: skip
    assert result.shares()["lb"] == pytest.approx(0.75, abs=0.03), result.shares()


# -- two workers, a rolling restart: mingle, gossip, autoscale, max-tasks-per-child, beat ----

#: Tasks per weighted queue, and the measured window, with two workers.
TWO = {"pa": 100, "pb": 300}
TWO_WINDOW = 200
#: ``--max-tasks-per-child`` of the second worker.
MAX_TASKS = 5
#: Beat's period (s) and the ticks to wait for.
BEAT_PERIOD = 1.0
TICKS = 3


def _probe_gossip(
    broker: str, events: EventLog, nodenames: Sequence[str], workers: Sequence[WorkerProcess]
) -> None:
    """Every worker's Gossip step hears the cluster's events and answers.

    Gossip consumes the ``worker.#`` events; an election request
    (``worker-elect``) is acknowledged by every listening node with a
    ``worker-elect-ack`` event.  Nothing runs: no node started the election.
    A worker that has just started sometimes misses the first request (plain
    Celery too, on both brokers): a request goes out every 5 s, each node must
    answer one of them.
    """
    probe = Celery("production-probe", broker=broker, set_as_current=False)
    elections: list[str] = []

    def acked() -> set[str]:
        return {
            str(e.get("hostname"))
            for e in events.of("worker-elect-ack")
            if e.get("id") in elections
        }

    try:
        with probe.connection_for_write() as conn:
            dispatcher = probe.events.Dispatcher(conn, hostname="probe@production-test")
            for _ in range(6):
                elections.append(f"probe-{uuid.uuid4().hex}")
                dispatcher.send("worker-elect", id=elections[-1], topic="none", action=None, cver=1)
                with contextlib.suppress(AssertionError):
                    wait_until(lambda: set(nodenames) <= acked(), "gossip acks", workers, 5)
                    break
                _alive(workers)
            dispatcher.close()
    finally:
        probe.close()
    heard = sorted({str(e.get("type")) for e in events.events})
    assert set(nodenames) <= acked(), f"acks from {acked()} of {list(nodenames)}; events {heard}"


@pytest.mark.parametrize("stack", BROKERS, indirect=True)
def test_two_workers_started_together_then_one_restarted(
    stack: Stack, producer: Celery, tmp_path: Path
) -> None:
    # prefork only: the pool deployments run by default, and the only one with
    # --autoscale and --max-tasks-per-child; the other pools run in the core test.
    env = stack.env(PRODUCTION_BEAT=str(BEAT_PERIOD), PRODUCTION_BEAT_QUEUE=EXTRA)
    queues = [*WEIGHTS, EXTRA]
    published = _publish_weighted(producer, TWO)
    # a: autoscaled from 1 to 3 processes, beat embedded.  b: children replaced
    # every MAX_TASKS tasks; b2 is b restarted (the same node name).
    a = WorkerProcess(
        stack.broker, queues, concurrency=3, app=APP, env=env,
        extra_args=[*FLAGS, "--autoscale=3,1", "-B", "-s", str(tmp_path / "beat-schedule")],
    )  # fmt: skip
    b_args = [*FLAGS, f"--max-tasks-per-child={MAX_TASKS}"]
    b = WorkerProcess(stack.broker, queues, concurrency=2, app=APP, env=env, extra_args=b_args)
    b2 = WorkerProcess(
        stack.broker, queues, concurrency=2, app=APP, env=env, extra_args=b_args, name=b.name
    )
    node_a, node_b = _node(a), _node(b)
    with EventLog(stack.broker) as events, running(a, b):
        # Started at the same moment, they usually miss each other (mingle
        # asks before a worker answers control commands); the restarted b
        # below must find a.
        measure_window(stack, list(WEIGHTS), TWO_WINDOW, [a, b])
        # b replaces its processes (it may have started later than a).
        wait_until(
            lambda: sum(e["worker"] == node_b for e in stack.ledger()) >= 3 * MAX_TASKS,
            f"{3 * MAX_TASKS} runs on b", [a, b],
        )  # fmt: skip
        # A rolling restart with the backlog still running: b finishes its
        # tasks and gives back what it had prefetched.
        first = stop_cleanly(b, node_b)
        with running(b2):
            wait_until(
                lambda: "mingle: sync complete" in b2.log() or "mingle: all alone" in b2.log(),
                "the restarted worker's mingle", [a, b2],
            )  # fmt: skip
            assert "mingle: sync with 1 nodes" in b2.log(), b2.log()[-3000:]
            assert f"sync with {node_b}" in a.log()  # a answered b2's mingle
            wait_until(
                lambda: None not in (events.hostname_of(a), events.hostname_of(b2)),
                "both workers' heartbeats", [a, b2],
            )  # fmt: skip
            _probe_gossip(stack.broker, events, [node_a, node_b], [a, b2])
            extras = _publish_extras(producer)
            record = producer.tasks["prod.record"]
            more = [record.apply_async(("pa", MS), queue="pa").id for _ in range(20)]
            expected = sum(TWO.values()) + extras.runs + len(more)

            def done() -> bool:
                entries = stack.ledger()
                ticks = sum(e["value"] == "tick" for e in entries)
                return ticks >= TICKS and len(entries) - ticks >= expected

            wait_until(done, f"{expected} runs and {TICKS} beat ticks", [a, b2])
            second = stop_cleanly(a, node_a)  # beat stops with it
            a_log = a.log()
            # b2 runs the ticks beat sent last (beat logs each one it sends).
            sent = a_log.count("Scheduler: Sending due task tick")
            known = {*published["pa"], *published["pb"], *extras.ids, *more}

            def ticks_run() -> set[str]:
                return {e["id"] for e in stack.ledger() if e["value"] == "tick"}

            def all_ticks() -> bool:
                # The result backend is scanned only while a tick is missing from the ledger.
                ran = ticks_run()
                return len(ran) >= sent or len(ran | _shrunk(stack, known, a_log)) >= sent

            def said() -> str:
                end = max(log_times(a_log, ""), default=time.time())  # a's last record
                tail = "\n".join(log_around(a_log, end, 60))
                return f"the {sent} ticks beat sent: {len(ticks_run())} ran; a's log:\n{tail}"

            wait_until(all_ticks, said, [b2])
            third = stop_cleanly(b2, node_b)
    entries = stack.ledger()
    ticks = {e["id"] for e in entries if e["value"] == "tick"}
    # A tick a's --autoscale killed as it started is failed, not run (plain Celery too).
    assert len(ticks | _shrunk(stack, known, a_log)) == sent >= TICKS
    assert_ran_once(
        entries,
        [*published["pa"], *published["pb"], *extras.ids, *more, *ticks],
        [first, second, third],
    )
    # Shares of both workers together, while both ran.
    weighted = [e for e in entries if e["queue"] in WEIGHTS and e["started"] < first.began]
    assert_weighted(window_shares(weighted, "queue", TWO_WINDOW), TWO_WINDOW, a_log, b.log())
    # --autoscale: a grew from its one process.
    assert "Scaling up" in a_log
    assert len({e["pid"] for e in entries if e["worker"] == node_a}) > 1
    # --max-tasks-per-child: no process of b ran more, and b replaced its children.
    b_runs = Counter(e["pid"] for e in entries if e["worker"] == node_b)
    assert max(b_runs.values()) <= MAX_TASKS, b_runs
    first_b = {e["pid"] for e in entries if e["worker"] == node_b and e["started"] < first.began}
    assert len(first_b) > 2, first_b
    assert any(e["worker"] == node_b and e["started"] > first.exited for e in entries)  # b2 ran
    # Results of every kind, and nothing left on the broker.
    _assert_results(producer, published)
    assert {producer.AsyncResult(t).get(timeout=30) for t in ticks} == {"tick"}
    _check_extras(extras, entries)
    _assert_nothing_left(stack, queues)


# -- celery multi with a keyed queue (Redis) --------------------------------------------

KEYED = "jobs"
#: Tasks per key (weights 3 and 1: each key's backlog lasts as long as the
#: other's) and the measured window.
KEY_WEIGHTS = {"gold": 3, "free": 1}
KEYED_TASKS = {"gold": 240, "free": 80}
KEYED_WINDOW = 160
#: Milliseconds a keyed task sleeps.
KEYED_MS = 5


@dataclass
class Multi:
    """``celery multi`` for two nodes, with their pid and log files in ``path``."""

    path: Path
    env: dict[str, str]
    nodes: tuple[str, str] = field(
        default_factory=lambda: (f"prodA{uuid.uuid4().hex[:6]}", f"prodB{uuid.uuid4().hex[:6]}")
    )

    def run(self, command: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "multi", command, *self.nodes,
             f"--pidfile={self.path}/%n.pid", f"--logfile={self.path}/%n.log", *args],
            cwd=ROOT, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    def pidfile(self, node: str) -> Path:
        return self.path / f"{node}.pid"

    def log(self, node: str) -> str:
        path = self.path / f"{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    pids: dict[str, int] = field(default_factory=dict)

    def alive(self) -> None:
        """Fail if a node that wrote its pid file has exited (multi start does not wait)."""
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                self.pids.setdefault(node, int(self.pidfile(node).read_text().strip()))
            if node in self.pids:
                try:
                    os.kill(self.pids[node], 0)
                except ProcessLookupError:
                    raise AssertionError(
                        f"{node} exited early:\n{self.log(node)[-3000:]}"
                    ) from None

    def wait(self, check: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            self.alive()
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n" + "\n".join(
                self.log(n)[-2000:] for n in self.nodes
            )
            time.sleep(0.05)

    def kill_leftovers(self) -> None:
        """After a failed stopwait: kill the nodes this test started, by their pids."""
        self.alive_pids_only()
        for pid in self.pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def alive_pids_only(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                self.pids.setdefault(node, int(self.pidfile(node).read_text().strip()))


def _publish_keyed(producer: Celery, counts: dict[str, int]) -> list[str]:
    """``record(key, KEYED_MS, key)``, the keys interleaved, by position and by keyword."""
    record = producer.tasks["prod.record"]
    ids: list[str] = []
    left = dict(counts)
    with producer.producer_or_acquire() as conn:
        while any(left.values()):
            for key in counts:
                if left[key]:
                    left[key] -= 1
                    if left[key] % 2:
                        result = record.apply_async(
                            (key, KEYED_MS, key), queue=KEYED, producer=conn
                        )
                    else:
                        kwargs = {"ms": KEYED_MS, "tenant_id": key}
                        result = record.apply_async((key,), kwargs, queue=KEYED, producer=conn)
                    ids.append(result.id)
    return ids


@pytest.mark.parametrize("stack", ["redis"], indirect=True)
def test_celery_multi_start_and_stopwait_with_a_keyed_queue(stack: Stack, tmp_path: Path) -> None:
    # Redis only: fair_keys live in the Redis fetch.  prefork, the pool
    # `celery multi` deployments run; the other pools run in the core test.
    keys = ",".join(f"{k}={w}" for k, w in KEY_WEIGHTS.items())
    env = stack.env(PRODUCTION_KEYS=f"{KEYED}=tenant_id", PRODUCTION_KEY_WEIGHTS=keys)
    producer = make_app(env, name="production-keyed-producer")
    producer.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
    ids = _publish_keyed(producer, KEYED_TASKS)
    multi = Multi(tmp_path, {**env, "PYTHONPATH": str(ROOT)})
    started = multi.run("start", "-A", APP, "-c", "2", "-Q", KEYED, "-l", "INFO", *FLAGS)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        multi.wait(
            lambda: stack.ledger_count([KEYED]) >= WARMUP + KEYED_WINDOW, "the measured runs"
        )
        client = redis_lib.Redis.from_url(stack.broker)
        backlog = {k: client.llen(KeyedNames(KEYED).key_list(k)) for k in KEY_WEIGHTS}
        assert all(backlog.values()), f"a key ran dry mid-window: {backlog}"
        # More work once both nodes are up (multi start does not wait for
        # them): a node holds two tasks at most, so both serve it.
        multi.wait(lambda: all(" ready." in multi.log(n) for n in multi.nodes), "both nodes")
        later = _publish_keyed(producer, {"gold": 12, "free": 4})
        ids += later
        multi.wait(lambda: stack.ledger_count() >= len(ids), f"{len(ids)} runs")
        stopped = multi.run("stopwait")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    finally:
        if any(multi.pidfile(n).exists() for n in multi.nodes):
            multi.run("stopwait")
            multi.kill_leftovers()
    # A node removes its pid file when it exits cleanly.
    assert not any(multi.pidfile(n).exists() for n in multi.nodes)
    for node in multi.nodes:
        log = multi.log(node)
        assert "mingle: searching for neighbors" in log and f"{node}@" in log
        assert_clean(log, node)
    entries = stack.ledger()
    assert_ran_once(entries, ids)
    assert {e["worker"].split("@")[0] for e in entries} == set(multi.nodes)  # both served
    # Key shares over both nodes: the keyed fetch is served on the broker, one
    # key order for every worker.
    first = [e for e in entries if e["id"] not in set(later)]
    shares = window_shares(first, "tenant", KEYED_WINDOW)
    assert shares["gold"] == pytest.approx(0.75, abs=0.06), shares  # see assert_weighted
    values = ResultSet([producer.AsyncResult(i) for i in ids]).get(timeout=30)
    assert Counter(values) == {"gold": 252, "free": 84}
    assert client.llen(KEYED) == 0 and client.hlen("unacked") == 0
    gc.collect()
    producer.close()
