"""A consumed queue deleted or removed mid-run: no crash, the other queues go on.

What plain Celery 5.7 does (measured with the same workloads, ``fair=False``):

* Redis, the list key deleted: nothing happens; BRPOP finds the key empty and
  the worker goes on with the other queues (a task published later runs).
* Redis, the queue removed from the consumer (``control cancel_consumer``):
  the worker stops polling it; the tasks left in it stay in Redis.
* RabbitMQ, ``queue.delete`` on a consumed queue: the broker cancels the
  consumer (``basic.cancel``); py-amqp raises ``ConsumerCancelled``, which
  Celery treats as a lost connection: it reconnects at once, declares the
  queue again (empty) and consumes every queue as before.  Nothing is lost.

celery-fair must do at least as well, and keep its scheduler consistent.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis as redis_lib

from tests.harness.brokers import broker_for
from tests.harness.control import wait_fair_stats
from tests.harness.harness import WorkerProcess

pytestmark = pytest.mark.integration


def ledger(url: str) -> list[dict]:
    return [json.loads(e) for e in redis_lib.Redis.from_url(url).lrange("ledger", 0, -1)]


def ids_in(url: str, queue: str) -> set[str]:
    client = redis_lib.Redis.from_url(url)
    return {json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)}


def wait_until(
    check: Callable[[], bool], worker: WorkerProcess, what: str, timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def share_between(entries: list[dict], first: int, last: int, queue: str) -> float:
    window = Counter(e["queue"] for e in entries[first:last])
    return window[queue] / sum(window.values())


def test_redis_list_deleted_mid_run(redis_url: str) -> None:
    counts = {"a": 600, "b": 1200, "c": 600}
    broker = broker_for(redis_url)
    broker.fill(counts, task="ledger", args=(2,))
    kept = ids_in(redis_url, "a") | ids_in(redis_url, "b")
    env = {"CELERY_FAIR_LEDGER": redis_url}
    args = ["--fair-weights", "a=1,b=2,c=1"]
    with WorkerProcess(redis_url, list(counts), env=env, extra_args=args) as worker:
        wait_until(lambda: len(ledger(redis_url)) >= 150, worker, "150 tasks")
        assert redis_lib.Redis.from_url(redis_url).delete("c") == 1
        deleted_at = len(ledger(redis_url))
        wait_until(lambda: len(ledger(redis_url)) >= deleted_at + 700, worker, "700 more")
        wait_until(lambda: kept <= {e["id"] for e in ledger(redis_url)}, worker, "a and b")
        stats = wait_fair_stats(redis_url)
    entries = ledger(redis_url)
    ran = Counter(e["id"] for e in entries)
    assert kept <= set(ran) and all(ran[i] == 1 for i in kept)  # all ran, once
    # a and b keep their 1:2 shares once c is gone (both still backlogged).
    assert share_between(entries, deleted_at + 50, deleted_at + 650, "b") == pytest.approx(
        2 / 3, abs=0.05
    )
    # The scheduler is consistent: c holds nothing, nothing waits, every
    # fetch is accounted for.
    assert stats["held"] == {"a": 0, "b": 0, "c": 0}
    assert sum(stats["waiting"].values()) == 0
    fetched_c = sum(1 for e in entries if e["queue"] == "c")
    assert stats["fetched"] == {"a": 600, "b": 1200, "c": fetched_c}
    assert stats["drr"]["queues"]["c"]["deficit"] >= -1  # no debt from its absence


def test_redis_queue_removed_from_the_consumer_and_added_back(redis_url: str) -> None:
    from tests.harness.control import control_app

    counts = {"a": 1000, "b": 2000, "c": 600}
    broker = broker_for(redis_url)
    broker.fill(counts, task="ledger", args=(2,))
    every = ids_in(redis_url, "a") | ids_in(redis_url, "b") | ids_in(redis_url, "c")
    env = {"CELERY_FAIR_LEDGER": redis_url}
    args = ["--fair-weights", "a=1,b=2,c=1"]
    client = redis_lib.Redis.from_url(redis_url)
    app = control_app(redis_url)
    with WorkerProcess(redis_url, list(counts), env=env, extra_args=args) as worker:
        wait_until(lambda: len(ledger(redis_url)) >= 150, worker, "150 tasks")
        reply = app.control.cancel_consumer("c", reply=True, timeout=5, limit=1)
        assert reply and "ok" in next(iter(reply[0].values())), reply
        removed_at = len(ledger(redis_url))
        left_in_c = client.llen("c")
        wait_until(lambda: len(ledger(redis_url)) >= removed_at + 700, worker, "700 more")
        stats = wait_fair_stats(redis_url)
        # c is no longer polled: its tasks wait in Redis, and it left the scheduler.
        assert client.llen("c") == left_in_c > 0
        assert set(stats["weights"]) == {"a", "b"}, stats["weights"]
        reply = app.control.add_consumer("c", reply=True, timeout=5, limit=1)
        assert reply and "ok" in next(iter(reply[0].values())), reply
        wait_until(lambda: every <= {e["id"] for e in ledger(redis_url)}, worker, "every task")
        back = wait_fair_stats(redis_url)
    entries = ledger(redis_url)
    assert Counter(e["id"] for e in entries) == Counter(every)  # each ran exactly once
    assert share_between(entries, removed_at + 50, removed_at + 650, "b") == pytest.approx(
        2 / 3, abs=0.05
    )
    # Added back with its configured weight; nothing left held or waiting.
    assert back["weights"]["c"] == 1.0
    assert back["held"] == {"a": 0, "b": 0, "c": 0} and sum(back["waiting"].values()) == 0


@pytest.mark.rabbitmq
def test_rabbitmq_queue_deleted_while_consumed(redis_url: str, rabbitmq_server: object) -> None:
    from kombu import Connection

    url = rabbitmq_server.url  # type: ignore[attr-defined]
    counts = {"da": 500, "db": 1000, "dc": 600}
    broker = broker_for(url)
    broker.purge(counts)
    broker.fill(counts, task="ledger", args=(5,))
    env = {"CELERY_FAIR_LEDGER": redis_url}
    args = ["--fair-weights", "da=1,db=2,dc=1"]
    try:
        with WorkerProcess(url, list(counts), env=env, extra_args=args) as worker:
            wait_until(lambda: len(ledger(redis_url)) >= 150, worker, "150 tasks")
            before = wait_fair_stats(url)
            with Connection(url) as conn:
                conn.channel().queue_delete(queue="dc")
            deleted_at = len(ledger(redis_url))
            wait_until(
                lambda: (
                    len({e["id"] for e in ledger(redis_url) if e["queue"] in ("da", "db")}) >= 1500
                ),
                worker,
                "every task of da and db",
            )
            after = wait_fair_stats(url)
            log = worker.log()
        entries = ledger(redis_url)
    finally:
        broker.purge(counts)
    assert "ConsumerCancelled" in log  # the broker cancelled the consumer...
    assert log.count("celery-fair: per-queue prefetch windows") == 2  # ...and it came back
    ran = Counter(e["id"] for e in entries if e["queue"] in ("da", "db"))
    assert len(ran) == 1500  # nothing of the remaining queues was lost
    # At most the tasks in the pool when the consumer was cancelled run twice
    # (their early acknowledgement went to the closed channel).
    assert sum(n - 1 for n in ran.values()) <= 2
    assert share_between(entries, deleted_at + 100, deleted_at + 700, "db") == pytest.approx(
        2 / 3, abs=0.05
    )
    # dc was declared again (empty) and is idle; the windows are the full ones
    # again, not Celery's reduced count right after a reconnection.
    assert after["prefetch_windows"] == before["prefetch_windows"]
    assert after["waiting"].get("dc", 0) == 0 and sum(after["waiting"].values()) == 0
