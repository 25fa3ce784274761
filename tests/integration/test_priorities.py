"""Priorities with fairness keys on Redis, with the real ``celery worker``.

A keyed queue's messages wait in the level of their Celery priority (Kombu's
priority lists: 0 is served first on Redis); within a level, keys share by
weight.  ``fair_priority="weighted"`` shares the worker between levels instead.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from tests.harness.harness import QUICK_STOP, WorkerProcess
from tests.harness.keys import keyed_app, most_at_once, publish_by_key, restore_unacked
from tests.harness.ledger import Entry, Ledger

pytestmark = [pytest.mark.integration]

QUEUE = "jobs"
SEP = "\x06\x16"


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    """A producer with ``fair_keys`` and Celery's own priority setting (the user's surface)."""
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    app.conf.task_queue_max_priority = 10
    yield app
    app.close()


def _worker(redis_url: str, **env: str) -> WorkerProcess:
    return WorkerProcess(
        redis_url,
        [QUEUE],
        concurrency=2,
        env={
            "CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id",
            "CELERY_FAIR_LEDGER": redis_url,
            "CELERY_FAIR_MAX_PRIORITY": "10",
            **env,
        },
    )


def _entries(ledger: Ledger, n: int, worker: WorkerProcess) -> list[Entry]:
    assert ledger.wait_for(n, timeout=120, alive=[worker]), worker.log()[-3000:]
    return sorted(ledger.entries(), key=lambda e: e.started)


@pytest.mark.compat
def test_urgent_work_first_and_keys_fair_within_the_batch_level(
    redis_url: str, producer: Celery
) -> None:
    weights = {"a": 1, "b": 2, "c": 4}
    # Batch work (priority 9, the last level on Redis) first, urgent work after it.
    publish_by_key(producer, QUEUE, {k: 100 * w for k, w in weights.items()}, ms=2, priority=9)
    publish_by_key(producer, QUEUE, {f"u{i}": 4 for i in range(5)}, ms=2, priority=0)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    assert client.smembers(names.levels) == {f"{SEP}9".encode()}
    assert client.zcard(names.active) == 5 and client.zcard(names.level(f"{SEP}9").active) == 3
    ledger = Ledger(redis_url)
    with _worker(redis_url, CELERY_FAIR_KEY_WEIGHTS="a=1,b=2,c=4") as worker:
        entries = _entries(ledger, 720, worker)
    started = [e.tenant or "" for e in entries]
    # The 20 urgent tasks were published last and are served first (two pool
    # processes: the 20th may start a moment after the first batch task).
    assert all(t.startswith("u") for t in started[:19]), started[:25]
    assert sum(t.startswith("u") for t in started[:22]) == 20, started[:25]
    window = [t for t in started[40:600]]  # every batch key backlogged throughout
    counts = Counter(window)
    for key, weight in weights.items():
        assert counts[key] / len(window) == pytest.approx(weight / 7, abs=0.02), counts
    assert len({e.id for e in entries}) == 720  # each ran once


def test_weighted_levels_share_the_worker_by_weight(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"hi-a": 300, "hi-b": 300}, ms=2, priority=0)
    publish_by_key(producer, QUEUE, {"lo-a": 300, "lo-b": 300}, ms=2, priority=9)
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_PRIORITY": "weighted", "CELERY_FAIR_PRIORITY_WEIGHTS": "0=4,9=1"}
    with _worker(redis_url, **env) as worker:
        entries = _entries(ledger, 600, worker)
        worker.stop(QUICK_STOP)  # measured
    window = [e.tenant or "" for e in entries[50:550]]  # both levels backlogged
    high = sum(t.startswith("hi-") for t in window) / len(window)
    assert high == pytest.approx(0.8, abs=0.02), Counter(window)
    # Within each level, its two keys alternate.
    lows = Counter(t for t in window if t.startswith("lo-"))
    assert abs(lows["lo-a"] - lows["lo-b"]) <= 2, lows


@pytest.mark.compat
def test_a_crash_restores_each_message_to_its_own_level(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"b0": 30, "b1": 30}, ms=20, priority=9)
    publish_by_key(producer, QUEUE, {"u0": 30, "u1": 30}, ms=20, priority=0)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    batch = names.level(f"{SEP}9")
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_ACKS_LATE": "1", "CELERY_FAIR_VISIBILITY": "2"}
    worker = _worker(redis_url, **env).start()
    try:
        assert ledger.wait_for(10, timeout=60, alive=[worker]), worker.log()[-3000:]
        worker.kill()
    finally:
        worker.stop()
    held = [json.loads(v) for v in client.hvals("unacked")]
    assert held  # the killed worker held urgent messages (served first)
    urgent_before = sum(client.llen(names.key_list(k)) for k in ("u0", "u1"))
    batch_before = sum(client.llen(batch.key_list(k)) for k in ("b0", "b1"))
    held_batch = sum(1 for m in held if m[0]["properties"].get("priority") == 9)
    restore_unacked(producer, client, visibility=2)
    # Each went back to its key's list in its own level; none to Kombu's own lists.
    assert client.llen(QUEUE) == 0 and client.llen(f"{QUEUE}{SEP}9") == 0
    assert sum(client.llen(batch.key_list(k)) for k in ("b0", "b1")) == batch_before + held_batch
    urgent_after = sum(client.llen(names.key_list(k)) for k in ("u0", "u1"))
    assert urgent_after == urgent_before + len(held) - held_batch
    with _worker(redis_url, **env) as worker:
        deadline = time.monotonic() + 120
        while len({e.id for e in ledger.entries()}) < 120:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            time.sleep(0.2)
    ran = Counter(e.tenant for e in {e.id: e for e in ledger.entries()}.values())
    assert ran == {"b0": 30, "b1": 30, "u0": 30, "u1": 30}  # every task ran; none lost


# -- RabbitMQ: the broker's own priority queues under DWRR and CoDel ----------------


@pytest.mark.rabbitmq
@pytest.mark.compat
def test_rabbitmq_priority_queue_under_dwrr_and_codel(rabbitmq_server: Any, redis_url: str) -> None:
    """``x-max-priority`` (Celery's ``task_queue_max_priority``) keeps the broker's order:
    priority 9 before a backlog of priority 0, under per-queue windows and CoDel; 0 lost."""
    suffix = uuid.uuid4().hex[:6]
    jobs, other = f"pjobs-{suffix}", f"pother-{suffix}"
    app = Celery("priority-producer", broker=rabbitmq_server.url, set_as_current=False)
    app.conf.task_queue_max_priority = 10
    celery_fair.install(app)
    publish_by_key(app, jobs, {"low": 300}, ms=2, priority=0)
    publish_by_key(app, jobs, {"high": 30}, ms=2, priority=9)  # on RabbitMQ 9 is first
    publish_by_key(app, other, {"other": 300}, ms=2)
    app.close()
    ledger = Ledger(redis_url)
    worker = WorkerProcess(
        rabbitmq_server.url,
        [jobs, other],
        concurrency=2,
        extra_args=["--fair-weights", f"{jobs}=1,{other}=1"],
        env={
            "CELERY_FAIR_LEDGER": redis_url,
            "CELERY_FAIR_MAX_PRIORITY": "10",
            # CoDel sends back tasks that waited over 5 ms in the worker's buffer.
            "CELERY_FAIR_CODEL": "0.005,0.02,requeue,3",
        },
    )
    with worker:
        entries = _entries(ledger, 630, worker)
    assert len({e.id for e in entries}) == 630  # every task ran once: none lost
    of_jobs = [e.tenant for e in entries if e.tenant in ("low", "high")]
    last_high = max(i for i, t in enumerate(of_jobs) if t == "high")
    # The high tasks ran ahead of the backlog of 300 low ones: at most a prefetch
    # window of low tasks (already at the worker when they came) ran before them.
    assert last_high < 30 + 70, of_jobs[:120]
    assert any(e.requeues for e in entries), "CoDel sent nothing back: the test saw no return"


@pytest.mark.rabbitmq
def test_a_codel_return_keeps_the_messages_priority_on_rabbitmq(rabbitmq_server: Any) -> None:
    from kombu import Connection, Exchange, Producer, Queue

    from celery_fair.kombu.requeue import return_copy

    name = f"preturn-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, Exchange(name), routing_key=name, max_priority=10)
    with Connection(rabbitmq_server.url) as conn:
        channel = conn.channel()
        producer = Producer(channel)
        producer.publish({"n": "urgent"}, exchange=queue.exchange, routing_key=name,
                         priority=9, declare=[queue])  # fmt: skip
        bound = queue(channel)
        message = _get(bound)
        for n in range(5):  # a backlog of lower priority behind it
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=name, priority=0)
        return_copy(message, name, {"fair_codel_requeues": 1}, front=True)
        message.ack()
        first = _get(bound)
        # The copy keeps priority 9, so the broker puts it ahead of the backlog.
        assert first.payload == {"n": "urgent"} and first.properties["priority"] == 9
        assert first.headers["fair_codel_requeues"] == 1
        bound.purge()
        bound.delete()


@pytest.mark.rabbitmq
def test_a_return_from_a_keyed_queues_lane_goes_back_to_that_lane(rabbitmq_server: Any) -> None:
    """On RabbitMQ a keyed task sent back (CoDel, an unknown task) returns to the lane
    of its key and level, not to the queue itself, where all levels share one order."""
    from kombu import Connection, Exchange, Producer, Queue

    from celery_fair.keys.lanes import lane_queue, level_lane
    from celery_fair.kombu.requeue import return_copy

    name = f"lreturn-{uuid.uuid4().hex[:6]}"
    parent = Queue(name, Exchange(name), routing_key=name, max_priority=10)
    lane = level_lane(name, f"{name}.fair.s3", 9)
    with Connection(rabbitmq_server.url) as conn:
        channel = conn.channel()
        bound_parent, bound_lane = parent(channel), lane_queue(parent, lane)(channel)
        bound_parent.declare()
        bound_lane.declare()
        Producer(channel).publish({"n": 1}, exchange="", routing_key=lane, priority=9,
                                  headers={"fair_key": "k"})  # fmt: skip
        message = _get(bound_lane)
        return_copy(message, name, {"fair_codel_requeues": 1}, front=False)
        message.ack()
        copy = _get(bound_lane)
        assert copy.payload == {"n": 1} and copy.properties["priority"] == 9
        assert copy.headers["fair_codel_requeues"] == 1 and copy.headers["fair_key"] == "k"
        assert bound_parent.get() is None  # nothing in the queue itself
        for bound in (bound_lane, bound_parent):
            bound.delete()


def _get(bound: Any, timeout: float = 10.0) -> Any:
    """The next message of a bound queue (``basic_get``), polled with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        message = bound.get()
        if message is not None:
            return message
        assert time.monotonic() < deadline, "no message arrived"
        time.sleep(0.05)


@pytest.mark.rabbitmq
def test_isolation_moves_a_noisy_keys_messages_with_their_priority(rabbitmq_server: Any) -> None:
    """The router's isolation queue gets the noisy key's messages with their priorities,
    and RabbitMQ serves them there in priority order."""
    from kombu import Connection, Queue

    from celery_fair.routing import ConsistentHashRouter
    from celery_fair.routing.isolation import IsolationPolicy

    tag = uuid.uuid4().hex[:6]
    shards = [f"ring{tag}.{i}" for i in range(2)]
    isolated = f"iso{tag}.isolated"
    app = Celery("isolation-producer", broker=rabbitmq_server.url, set_as_current=False)
    app.conf.task_queue_max_priority = 10
    policy = IsolationPolicy(isolated, half_life=60.0, hold=60.0)
    app.conf.task_routes = (ConsistentHashRouter(shards, key="tenant_id", isolate=policy),)
    celery_fair.install(app)
    with app.producer_or_acquire() as producer:
        for i in range(80):  # one key only: past 30 messages it is the noisy one
            app.send_task(
                "ledger", kwargs={"ms": 0, "tenant_id": "noisy"}, producer=producer,
                priority=9 if i % 2 else 1,
            )  # fmt: skip
    app.close()
    with Connection(rabbitmq_server.url) as conn:
        bound = Queue(isolated, max_priority=10)(conn.channel())
        got = []
        while (message := bound.get(no_ack=True)) is not None:
            got.append(message.properties.get("priority"))
        channel = conn.channel()
        for name in (*shards, isolated):
            channel.queue_delete(name)  # RabbitMQ: nothing to do for a queue never declared
    # Isolated after the first 30 or so; with their priorities, 9 served first there.
    assert 30 <= len(got) <= 50, got
    assert sorted(got, reverse=True) == got and set(got) == {1, 9}, got


@pytest.mark.rabbitmq
def test_parking_and_replay_keep_the_priority_on_rabbitmq(rabbitmq_server: Any) -> None:
    from kombu import Connection, Exchange, Producer, Queue

    from celery_fair.parked import parking_queue
    from celery_fair.parking.store import AmqpParking

    name = f"ppark-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, Exchange(name), routing_key=name, max_priority=10)
    with Connection(rabbitmq_server.url) as conn:
        channel = conn.channel()
        Producer(channel).publish({"n": "bad"}, exchange=queue.exchange, routing_key=name,
                                  priority=9, declare=[queue])  # fmt: skip
        bound = queue(channel)
        parking = AmqpParking(channel)
        parking.park(_get(bound), name, "test: bad input")
        parked = parking.list(name)
        assert len(parked) == 1
        assert parking.replay(name) == 1
        back = _get(bound)
        assert back.payload == {"n": "bad"} and back.properties["priority"] == 9
        back.ack()
        channel.queue_delete(name)
        channel.queue_delete(parking_queue(name))


def test_a_codel_return_of_a_keyed_message_goes_back_to_its_level(redis_url: str) -> None:
    """CoDel and the unknown-task quarantine send copies back with ``put_payload``: a
    keyed message returns to its key's list in its own priority level."""
    from kombu import Connection

    from celery_fair.kombu.requeue import put_payload
    from celery_fair.wire import KEY_HEADER, KEYED_HEADER

    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    payload = {
        "body": "",
        "headers": {KEY_HEADER: "a", KEYED_HEADER: QUEUE},
        "properties": {"priority": 9, "delivery_info": {"routing_key": QUEUE}},
    }
    with Connection(redis_url) as conn:
        put_payload(conn.default_channel, QUEUE, payload, front=True)
    assert client.llen(names.level(f"{SEP}9").key_list("a")) == 1
    assert client.llen(names.key_list("a")) == 0 and client.llen(f"{QUEUE}{SEP}9") == 0


def test_a_keys_limit_holds_across_its_levels(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"a": 20, "b": 20}, ms=20, priority=9)
    publish_by_key(producer, QUEUE, {"a": 20}, ms=20, priority=0)
    ledger = Ledger(redis_url)
    with _worker(redis_url, CELERY_FAIR_KEY_CONCURRENCY="a=1") as worker:
        entries = _entries(ledger, 60, worker)
    assert most_at_once(entries)["a"] == 1  # one at a time, whatever the level
    assert Counter(e.tenant for e in entries) == {"a": 40, "b": 20}
