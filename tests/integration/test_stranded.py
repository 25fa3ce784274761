"""Nothing stranded: pool children replaced after the worker's keyed-queue check still start.

Issue #49's reproduction: two workers started together on Redis, as
deployments start them (Celery's defaults, ``-E -O fair``, late acks with a
prefetch multiplier of 1, a Redis result backend), consuming weighted queues
and a keyed queue; one replaces its pool children with
``--max-tasks-per-child``.  A worker that consumes a keyed queue asks the
cluster at start, by remote control, for plain consumers of it.  The replies
were collected on a connection of the app's pool, which went back to the pool
with a poll of the reply queue still in flight.  Every pool child forked
afterwards closes that pool's connections (Kombu's after-fork cleanup); the
close reads the poll's reply from the socket it shares with its parent, and
after the first child had read it, every later child waited for a reply that
never came.  Celery killed each one after ``worker_proc_alive_timeout``
("Timed out waiting for UP message") and forked another, which hung too: the
worker never ran another task, and what it had reserved waited for the
visibility timeout.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery

from tests.harness.harness import WorkerProcess
from tests.integration.production_app import make_app
from tests.integration.test_production import (
    APP,
    FLAGS,
    assert_clean,
    assert_ran_once,
    running,
    stop_cleanly,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.compat]

KEYED = "jobs"
WEIGHTED = {"hi": 4, "lo": 1}
#: Tasks per child of the worker that replaces its children: about a hundred
#: replacements over the run.
MAX_TASKS = 3
#: Tasks published before the workers start, and, for the churning worker alone,
#: after both were ready and the keyed-queue check had its time (two
#: remote-control rounds of 2 s each): SECOND / MAX_TASKS children at least.
FIRST, SECOND = 300, 240
CHECKED = 6.0
MS = 2


@pytest.fixture
def env(redis_url: str) -> dict[str, str]:
    backend = redis_url.rsplit("/", 1)[0] + "/1"
    return {
        "CELERY_FAIR_BROKER": redis_url,
        "PRODUCTION_BACKEND": backend,
        "PRODUCTION_LEDGER": redis_url,
        "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in WEIGHTED.items()),
        "PRODUCTION_KEYS": f"{KEYED}=tenant_id",
        "PRODUCTION_VISIBILITY": "3600",
    }


@pytest.fixture
def producer(env: dict[str, str]) -> Iterator[Celery]:
    app = make_app(env, name="stranded-producer")
    app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
    yield app
    redis_lib.Redis.from_url(env["PRODUCTION_BACKEND"]).flushdb()
    app.close()


def _publish(producer: Celery, n: int) -> list[str]:
    record = producer.tasks["prod.record"]
    queues = ("hi", "hi", "hi", "hi", "lo", KEYED)
    ids = []
    with producer.producer_or_acquire() as conn:
        for i in range(n):
            queue = queues[i % len(queues)]
            kwargs = {"ms": MS, "tenant_id": f"t{i % 5}"} if queue == KEYED else {"ms": MS}
            ids.append(record.apply_async((i,), kwargs, queue=queue, producer=conn).id)
    return ids


def _ledger(url: str) -> list[dict[str, object]]:
    import json

    return [json.loads(raw) for raw in redis_lib.Redis.from_url(url).lrange("ledger", 0, -1)]


def test_children_forked_after_the_keyed_check_start_and_run_everything(
    env: dict[str, str], producer: Celery
) -> None:
    ids = _publish(producer, FIRST)
    queues = [*WEIGHTED, KEYED]
    churn = WorkerProcess(
        env["CELERY_FAIR_BROKER"], queues, concurrency=2, app=APP, env=env,
        extra_args=[*FLAGS, f"--max-tasks-per-child={MAX_TASKS}"],
    )  # fmt: skip
    scaled = WorkerProcess(
        env["CELERY_FAIR_BROKER"], queues, concurrency=3, app=APP, env=env,
        extra_args=[*FLAGS, "--autoscale=3,1"],
    )  # fmt: skip
    ledger = redis_lib.Redis.from_url(env["PRODUCTION_LEDGER"])
    with running(churn, scaled):
        wait_until(lambda: all(" ready." in w.log() for w in (churn, scaled)), "both ready",
                   [churn, scaled])  # fmt: skip
        ready = time.monotonic()
        wait_until(
            lambda: ledger.llen("ledger") >= FIRST and time.monotonic() - ready > CHECKED,
            "the first tasks and the keyed-queue check", [churn, scaled],
        )  # fmt: skip
        # The other worker has answered the check; it stops now, so the second batch
        # is the churning worker's alone, whatever share each would have taken.
        stopped = [stop_cleanly(scaled)]
        second = time.time()
        ids += _publish(producer, SECOND)
        wait_until(
            lambda: ledger.llen("ledger") >= len(ids),
            lambda: f"{len(ids)} runs (ran {ledger.llen('ledger')})",
            [churn], timeout=180,
        )  # fmt: skip
        stopped.append(stop_cleanly(churn))
    entries = _ledger(env["PRODUCTION_LEDGER"])
    assert_ran_once(entries, ids, stopped)
    for worker in (churn, scaled):
        log = worker.log()
        assert "Timed out waiting for UP message" not in log, log[-4000:]
        assert_clean(log, worker.name)
    # After the check, the worker replaced its children again and again (each ran
    # at most MAX_TASKS) and they started: with the stall, no child forked after
    # the check ran anything but the one that took the stray reply.
    node = f"{churn.name}@{socket.gethostname()}"
    runs = Counter(e["pid"] for e in entries if e["worker"] == node and e["started"] > second)
    assert sum(runs.values()) == SECOND, runs
    assert len(runs) >= SECOND // MAX_TASKS and max(runs.values()) <= MAX_TASKS, runs
    assert redis_lib.Redis.from_url(env["CELERY_FAIR_BROKER"]).hlen("unacked") == 0


def test_the_watchdog_reports_tasks_the_pool_took_and_never_started(
    redis_url: str, tmp_path: Path
) -> None:
    """Pool processes that never come up: the tasks the pool took are stalls, logged and
    counted; they run once the processes do."""
    flag = tmp_path / "hang"
    env = {"STALL_FLAG": str(flag), "STALL_LEDGER": redis_url}
    worker = WorkerProcess(
        redis_url, ["hi", "lo"], concurrency=2, app="tests.integration.stall_app", env=env,
        extra_args=[*FLAGS, "--max-tasks-per-child=1"],
    )  # fmt: skip
    producer = Celery("stall-producer", broker=redis_url, set_as_current=False)
    record = producer.signature("stall.record")
    ledger = redis_lib.Redis.from_url(redis_url)
    with running(worker):
        wait_until(lambda: " ready." in worker.log(), "the worker", [worker])
        record.clone((0,)).apply_async(queue="hi")
        wait_until(lambda: ledger.llen("ran") == 1, "the first task", [worker])
        # Its child exits after that task; the ones forked from now on hang.
        flag.touch()
        for i in range(1, 4):
            record.clone((i,)).apply_async(queue="hi" if i % 2 else "lo")
        wait_until(lambda: "celery-fair: stall: task" in worker.log(), "a stall", [worker])
        with producer.connection_for_write() as connection:
            [replies] = producer.control.broadcast(
                "fair_stats", reply=True, timeout=5, limit=1, connection=connection
            )
        [reply] = replies.values()
        assert reply["stalls"]["stalls"].get("pool", 0) >= 1, reply["stalls"]
        assert reply["stalls"]["repaired"] == 0  # nothing of celery-fair's to repair
        line = next(x for x in worker.log().splitlines() if "celery-fair: stall: task" in x)
        assert "WARNING" in line and "the pool took it and has not started it" in line
        flag.unlink()
        wait_until(lambda: ledger.llen("ran") == 4, "every task, once the pool is up", [worker])
    assert sorted(int(v) for v in ledger.lrange("ran", 0, -1)) == [0, 1, 2, 3]
    producer.close()
