"""CoDel in real workers: stale prefetched tasks go back and run elsewhere."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis as redis_lib

from tests.harness.harness import WorkerProcess, fill_queues

pytestmark = pytest.mark.integration


def ledger(url: str) -> list[dict]:
    return [json.loads(x) for x in redis_lib.Redis.from_url(url).lrange("ledger", 0, -1)]


def wait_for(url: str, n: int, workers: list[WorkerProcess], timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            assert w.proc is not None and w.proc.poll() is None, w.log()[-3000:]
        entries = ledger(url)
        if len({e["id"] for e in entries}) >= n:
            return entries
        time.sleep(0.1)
    raise AssertionError(f"only {len(ledger(url))} of {n} tasks ran")


def test_slow_worker_returns_stale_tasks_and_a_fast_one_runs_them(redis_url: str) -> None:
    n = 60
    fill_queues(redis_url, {"jobs": n}, task="ledger", args=(5,))
    common = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_PREFETCH_MULTIPLIER": "10"}
    slow = WorkerProcess(
        redis_url, ["jobs"], concurrency=1,
        env={**common, "CELERY_FAIR_SLOW_MS": "200", "CELERY_FAIR_CODEL": "0.05,0.3"},
    ).start()  # fmt: skip
    try:
        # Let the slow worker fill its window before the fast one arrives.
        deadline = time.monotonic() + 60
        while redis_lib.Redis.from_url(redis_url).llen("jobs") > n - 10:
            assert time.monotonic() < deadline, slow.log()[-2000:]
            time.sleep(0.05)
        fast = WorkerProcess(redis_url, ["jobs"], concurrency=2, env=common).start()
        try:
            entries = wait_for(redis_url, n, [slow, fast])
        finally:
            fast.stop()
    finally:
        slow.stop()
    runs = Counter(e["id"] for e in entries)
    assert len(runs) == n and set(runs.values()) == {1}, "every task ran exactly once"
    returned = [e for e in entries if e["requeues"] > 0]
    assert returned, "the slow worker sent stale tasks back"
    # Returned tasks reach the fast worker, and it runs most of the work. Which
    # worker fetches a given returned task is a race (the slow one polls the
    # same queue and may take it again when a slot frees), so the share of the
    # returned tasks on each worker depends on the machine's load.
    on_fast = [e for e in returned if e["worker"].split("@")[0] == fast.name]
    assert on_fast, "a returned task ran on the fast worker"
    by_worker = Counter(e["worker"].split("@")[0] for e in entries)
    assert by_worker[fast.name] > by_worker[slow.name], by_worker


@pytest.mark.compat
def test_requeue_cap_is_honoured_and_nothing_is_lost(redis_url: str) -> None:
    n = 30
    fill_queues(redis_url, {"capped": n}, task="ledger", args=(0,))
    worker = WorkerProcess(
        redis_url, ["capped"], concurrency=1,
        env={
            "CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_PREFETCH_MULTIPLIER": "10",
            "CELERY_FAIR_SLOW_MS": "100", "CELERY_FAIR_CODEL": "0.02,0.1,requeue,1",
        },
    ).start()  # fmt: skip
    try:
        entries = wait_for(redis_url, n, [worker])
    finally:
        worker.stop()
    runs = Counter(e["id"] for e in entries)
    assert len(runs) == n and set(runs.values()) == {1}
    assert max(e["requeues"] for e in entries) == 1  # returned once at most, then ran


@pytest.mark.rabbitmq
def test_reject_mode_dead_letters_on_rabbitmq(rabbitmq_server: object, redis_url: str) -> None:
    from kombu import Connection, Exchange, Queue

    url = rabbitmq_server.url  # type: ignore[attr-defined]
    n = 30
    dead = Queue("dead-jobs", Exchange("dlx", type="direct"), routing_key="dljobs")
    with Connection(url) as conn:
        dead(conn.default_channel).declare()
    env = {"CELERY_FAIR_DLX_QUEUES": "dljobs"}
    import os

    os.environ.update(env)  # the filler declares the queue like the worker
    try:
        from tests.harness.brokers import AmqpBroker

        broker = AmqpBroker(url)
        broker.app.conf.task_queues = [
            Queue("dljobs", Exchange("dljobs"), routing_key="dljobs", durable=True,
                  queue_arguments={"x-dead-letter-exchange": "dlx",
                                   "x-dead-letter-routing-key": "dljobs"})
        ]  # fmt: skip
        broker.fill({"dljobs": n}, task="ledger", args=(0,))
    finally:
        for key in env:
            os.environ.pop(key, None)
    worker = WorkerProcess(
        url, ["dljobs"], concurrency=1,
        env={
            **env, "CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_PREFETCH": "10",
            "CELERY_FAIR_SLOW_MS": "100", "CELERY_FAIR_CODEL": "0.02,0.1,reject",
        },
    ).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            ran = len(ledger(redis_url))
            with Connection(url) as conn:
                dead_count = dead(conn.default_channel).queue_declare(passive=True).message_count
            if ran + dead_count >= n:
                break
            assert time.monotonic() < deadline, (ran, dead_count)
            time.sleep(0.1)
    finally:
        worker.stop()
    assert dead_count > 0, "stale tasks were dead-lettered"
    assert ran + dead_count == n, "each task either ran or was dead-lettered"


@pytest.mark.compat
def test_adaptive_prefetch_shrinks_the_window_of_a_slow_worker(redis_url: str) -> None:
    # Regression: the window must really bind (Celery's loop re-applies its
    # QoS value, so setting the prefetch count alone was undone at once).
    fill_queues(redis_url, {"adapt": 200}, task="ledger", args=(30,))
    client = redis_lib.Redis.from_url(redis_url)
    worker = WorkerProcess(
        redis_url, ["adapt"], concurrency=1,
        env={"CELERY_FAIR_PREFETCH": "auto", "CELERY_FAIR_PREFETCH_MULTIPLIER": "26"},
    ).start()  # fmt: skip
    try:
        # The first window (26) is fetched before there is any estimate; once
        # it is worked off, the adaptive window must hold.
        deadline = time.monotonic() + 60
        while client.llen("adapt") > 150 or int(client.hlen("unacked")) > 3:
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
            assert time.monotonic() < deadline, "the window never shrank"
            time.sleep(0.05)
        samples: list[int] = []
        while len(samples) < 30 and client.llen("adapt") > 0:
            samples.append(int(client.hlen("unacked")))
            time.sleep(0.05)
    finally:
        worker.stop()
    # Plain Celery would hold 26 unacknowledged messages here; round trip /
    # service time calls for 1 per slot plus 1 spare.
    assert samples and max(samples) <= 3, samples


@pytest.mark.rabbitmq
@pytest.mark.parametrize("pool", [pytest.param("prefork", marks=pytest.mark.compat), "threads"])
def test_adaptive_prefetch_shrinks_the_windows_on_rabbitmq(
    rabbitmq_server: object, redis_url: str, pool: str
) -> None:
    # RabbitMQ's per-consumer window cannot change on a live consumer: the
    # worker re-consumes (basic.cancel, basic.qos, basic.consume) on the same
    # channel, and no message is lost or run twice on the way.
    from tests.harness.brokers import AmqpBroker

    url = rabbitmq_server.url  # type: ignore[attr-defined]
    n = 200
    broker = AmqpBroker(url)
    broker.purge(["adapt-amqp"])
    broker.fill({"adapt-amqp": n}, task="ledger", args=(30,))
    worker = WorkerProcess(
        url, ["adapt-amqp"], pool=pool, concurrency=1,
        env={"CELERY_FAIR_PREFETCH": "auto", "CELERY_FAIR_PREFETCH_MULTIPLIER": "26",
             "CELERY_FAIR_LEDGER": redis_url},
    ).start()  # fmt: skip

    def held() -> int:
        # Early acks: a task is acked when it starts, and recorded when it
        # ends, so the unacknowledged messages are what is neither ready nor
        # recorded, less the one running (at most).
        return n - broker.lengths(["adapt-amqp"])["adapt-amqp"] - len(ledger(redis_url))

    try:
        # The first window (26) is delivered before any estimate exists and
        # is worked off; then the adaptive window must hold.
        deadline = time.monotonic() + 60
        while broker.lengths(["adapt-amqp"])["adapt-amqp"] > n - 60 or held() > 4:
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
            assert time.monotonic() < deadline, f"the window never shrank: {held()} held"
            time.sleep(0.05)
        samples: list[int] = []
        while len(samples) < 30 and broker.lengths(["adapt-amqp"])["adapt-amqp"] > 0:
            samples.append(held())
            time.sleep(0.05)
        entries = wait_for(redis_url, n, [worker])
    finally:
        worker.stop()
    # Plain Celery would hold 26; round trip / service time calls for 1 per
    # slot plus 1 spare (plus the running task, counted here until it ends).
    # With threads the window change is decided on a pool thread and applied
    # on the consumer's thread at its next delivery.
    assert samples and max(samples) <= 4, samples
    runs = Counter(e["id"] for e in entries)
    assert len(runs) == n and set(runs.values()) == {1}, "nothing lost, nothing run twice"
    assert "'reconsumes': " in worker.log() and "'reconsumes': 0" not in worker.log()
