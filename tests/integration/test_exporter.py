"""``celery-fair exporter`` against the broker's truth, with and without workers running."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis as redis_lib
from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from celery_fair.parked import NOT_A_MESSAGE, encode_record
from tests.harness.exporter import ExporterProcess, Samples, parse_samples
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key

pytestmark = [pytest.mark.integration]

KEYED, PLAIN = "jobs", "mail"


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def plain_app(redis_url: str) -> Iterator[Celery]:
    app = Celery("exporter-plain", broker=redis_url, set_as_current=False)
    celery_fair.install(app)  # stamps the publish time the ages come from
    yield app
    app.close()


def _truth(client: redis_lib.Redis) -> dict[str, int]:
    """Waiting messages per queue, read the long way: every list, every key."""
    names = KeyedNames(KEYED)
    keyed = sum(client.llen(k) for k in client.scan_iter(f"{KEYED}\x06\x16fair.k.*"))
    plain = sum(client.llen(k) for k in (PLAIN, f"{PLAIN}\x06\x163", f"{PLAIN}\x06\x166"))
    assert int(client.hget(names.state, "backlog") or 0) == keyed
    return {KEYED: keyed + client.llen(KEYED), PLAIN: plain}


def test_the_exporter_tells_the_brokers_truth_without_any_worker(
    redis_url: str, plain_app: Celery
) -> None:
    producer = keyed_app(redis_url, {KEYED: "tenant_id"})
    try:
        publish_by_key(producer, KEYED, {"big": 30, "mid": 10, "small": 5}, ms=0)
    finally:
        producer.close()
    for _ in range(7):
        plain_app.send_task("x", queue=PLAIN)
    for _ in range(3):
        plain_app.send_task("x", queue=PLAIN, priority=5)  # Kombu's priority list
    plain_app.send_task("x", queue=KEYED)  # a producer without fair_keys: the unkeyed list
    client = redis_lib.Redis.from_url(redis_url)
    client.lpush(
        f"{PLAIN}.fair-malformed",
        encode_record(None, reason=NOT_A_MESSAGE, parked_at=time.time(), queue=PLAIN, raw="x"),
    )
    truth = _truth(client)
    assert truth == {KEYED: 46, PLAIN: 10}
    assert client.llen(KEYED) == 1 and client.llen(PLAIN) == 7  # what LLEN-based tools see
    published = time.time()
    with ExporterProcess(redis_url, [KEYED, PLAIN]) as exporter:
        samples = exporter.scrape()
    assert value(samples, "celery_fair_exporter_up") == 1.0
    # The broker's memory against its maxmemory (the CeleryFairBrokerMemoryHigh alert).
    used = value(samples, "celery_fair_broker_memory_used_bytes")
    assert used is not None and 0.5 < used / int(client.info("memory")["used_memory"]) < 2
    maxmemory = int(client.config_get("maxmemory")["maxmemory"])
    assert value(samples, "celery_fair_broker_memory_max_bytes") == maxmemory
    for queue, waiting in truth.items():
        assert value(samples, "celery_fair_queue_backlog", queue=queue) == waiting
        assert value(samples, "celery_fair_queue_unacked", queue=queue) == 0
        age = value(samples, "celery_fair_queue_oldest_age_seconds", queue=queue)
        assert age is not None and 0 < age < time.time() - published + 60
    assert value(samples, "celery_fair_keyed_active_keys", queue=KEYED) == 3
    largest = {
        dict(labels)["key"]: v
        for (name, labels), v in samples.items()
        if name == "celery_fair_key_backlog"
    }
    assert largest == {"big": 30, "mid": 10, "small": 5}
    assert value(samples, "celery_fair_queue_parked", queue=PLAIN, reason="not-a-message") == 1
    assert value(samples, "celery_fair_keyed_active_keys", queue=PLAIN) is None  # not keyed


def test_the_exporter_follows_a_running_worker_and_a_limit(redis_url: str) -> None:
    producer = keyed_app(redis_url, {KEYED: "tenant_id"})
    try:
        # 300 ms tasks, concurrency 1 per key: "flood" is held at its limit.
        publish_by_key(producer, KEYED, {"flood": 40, "quiet": 4}, ms=300)
    finally:
        producer.close()
    client = redis_lib.Redis.from_url(redis_url)
    env = {
        "CELERY_FAIR_KEYS": f"{KEYED}=tenant_id",
        "CELERY_FAIR_KEY_CONCURRENCY": "*=1",
        "CELERY_FAIR_ACKS_LATE": "1",  # a running task stays in the unacked hash
    }
    with (
        ExporterProcess(redis_url, [KEYED]) as exporter,
        WorkerProcess(redis_url, [KEYED], concurrency=2, env=env) as worker,
    ):

        def consistent(samples: Samples) -> bool:
            # The truth, read just before and after the scrape, did not move.
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
            in_flight = client.hlen("unacked")
            return (
                in_flight > 0
                and value(samples, "celery_fair_queue_unacked", queue=KEYED) == in_flight
                and value(samples, "celery_fair_queue_backlog", queue=KEYED)
                == _truth(client)[KEYED]
                and client.hlen("unacked") == in_flight
            )

        exporter.wait_until(consistent)
        exporter.wait_until(
            lambda s: value(s, "celery_fair_keys_throttled", queue=KEYED, limit="concurrency") == 1
        )
        records = [json.loads(r) for r in client.hvals("unacked")]
        assert all(r[2] == KEYED for r in records)
        # Drained: the figures go to zero, and the exporter keeps going after the worker.
        exporter.wait_until(
            lambda s: value(s, "celery_fair_queue_backlog", queue=KEYED) == 0, timeout=60
        )
    with ExporterProcess(redis_url, [KEYED]) as exporter:
        samples = exporter.scrape()
    assert value(samples, "celery_fair_queue_backlog", queue=KEYED) == 0
    assert value(samples, "celery_fair_keyed_active_keys", queue=KEYED) in (0, None)


@pytest.mark.rabbitmq
def test_the_exporter_reads_rabbitmq(rabbitmq_server: object) -> None:
    url = rabbitmq_server.url  # type: ignore[attr-defined]
    app = Celery("exporter-amqp", broker=url, set_as_current=False)
    try:
        for _ in range(12):
            app.send_task("x", queue="amqp_q")
    finally:
        app.close()
    with ExporterProcess(url, ["amqp_q", "never_declared"]) as exporter:
        samples = exporter.scrape()
    assert value(samples, "celery_fair_exporter_up") == 1.0
    assert value(samples, "celery_fair_queue_backlog", queue="amqp_q") == 12
    assert value(samples, "celery_fair_queue_consumers", queue="amqp_q") == 0
    assert value(samples, "celery_fair_queue_backlog", queue="never_declared") == 0


@pytest.mark.rabbitmq
def test_the_exporter_counts_rabbitmqs_unacknowledged_through_the_management_api() -> None:
    from tests.harness.rabbitmq import RabbitMQServer

    with RabbitMQServer(management=True) as server:
        app = Celery("exporter-amqp-mgmt", broker=server.url, set_as_current=False)
        try:
            for _ in range(30):
                app.send_task("nap", args=(500,), queue="held_q")
        finally:
            app.close()
        # A worker that holds its prefetched tasks unacknowledged (late acks).
        env = {"CELERY_FAIR_ACKS_LATE": "1"}
        api = ("--rabbitmq-api", server.management_url)
        with (
            WorkerProcess(server.url, ["held_q"], concurrency=2, env=env) as worker,
            ExporterProcess(server.url, ["held_q"], *api) as exporter,
        ):

            def in_flight(samples: Samples) -> bool:
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
                held = value(samples, "celery_fair_queue_unacked", queue="held_q") or 0
                ready = value(samples, "celery_fair_queue_backlog", queue="held_q") or 0
                return held >= 2 and held + ready <= 30

            samples = exporter.wait_until(in_flight, timeout=90)
        assert value(samples, "celery_fair_queue_consumers", queue="held_q") == 1


def test_the_exporter_finds_a_queue_named_only_at_the_call(
    redis_url: str, plain_app: Celery
) -> None:
    # No task_queues, no route, no setting names it: only the call does.
    for _ in range(3):
        plain_app.send_task("x", queue="adhoc-only")
    done = subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "exporter", "-b", redis_url, "--once"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    samples = parse_samples(done.stdout)
    assert value(samples, "celery_fair_queue_backlog", queue="adhoc-only") == 3, done.stdout
    # Celery's own broadcast queues are not reported.
    assert not any("pidbox" in dict(labels).get("queue", "") for _, labels in samples)
    # Without discovery only the named queues are read.
    named = subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "exporter", "-b", redis_url, "--once",
         "--discover-every", "0", "--queues", "celery"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        value(parse_samples(named.stdout), "celery_fair_queue_backlog", queue="adhoc-only") is None
    )
