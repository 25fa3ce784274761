"""Scheduled tasks on the broker (``fair_eta = "broker"``), on a real Redis.

The scripts first, called directly: a due message moves from its queue's
schedule into the queue (or its key's list) inside the fetch, at most
``ETA_BATCH`` per queue and fetch, in due order; one not due stays.  Then the
real ``celery worker`` (prefork, as users run it): countdown tasks on a plain
and on a keyed queue wait on the broker, not in the worker (``inspect
scheduled``/``reserved`` show none of them), each runs once and none starts
before its eta; a retry's countdown goes the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import celery_fair
from celery_fair.keys import scripts, store
from celery_fair.keys.eta import due_time
from celery_fair.keys.layout import ETA_BATCH, KeyedNames
from celery_fair.wire.replies import Idle, KeyedMessage, Message, decode_fetch
from tests.harness.control import wait_fair_stats
from tests.harness.harness import QUICK_STOP, WorkerProcess, poll_until

SEP = "\x06\x16"
PLAIN, KEYED = "sched", "jobs"
ROOT = Path(__file__).resolve().parents[2]


def payload(n: int, priority: int | None = None) -> str:
    """A Kombu Redis payload with a delivery tag, as the fetch needs."""
    properties: dict[str, Any] = {
        "delivery_tag": str(uuid.uuid4()),
        "delivery_info": {"exchange": "", "routing_key": ""},
    }
    if priority is not None:
        properties["priority"] = priority
    return json.dumps({"body": "", "headers": {"n": n}, "properties": properties})


def number(item: Any) -> int:
    raw = item.decode() if isinstance(item, bytes) else item
    n: int = json.loads(raw)["headers"]["n"]
    return n


def fetch(client: Any, queue: str, word: str = "-") -> Any:
    """One run of the fetch script over ``queue`` (a plain list, or keyed with ``word``)."""
    return client.eval(
        scripts.FETCH.text,
        5,
        queue, queue + ".fair-malformed", "unacked", "unacked_index",
        KeyedNames(queue, SEP).schedule_next,
        *store.fetch_args([word], sep=SEP, now=time.time(), schedules=[queue]),
    )  # fmt: skip


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    yield redis.Redis.from_url(redis_url)


def test_a_fetch_moves_at_most_a_batch_of_due_messages_in_due_order(client: Any) -> None:
    names = KeyedNames(PLAIN, SEP)
    past = time.time() - 100
    extra = 30
    # Scheduled out of order: they come due, and are served, by due time.
    for n in reversed(range(ETA_BATCH + extra)):
        store.schedule(client, names, past + n * 0.001, payload(n))
    for n in range(5):  # due in an hour: they stay
        store.schedule(client, names, time.time() + 3600, payload(1000 + n))
    assert store.scheduled(client, names) == ETA_BATCH + extra + 5

    first = decode_fetch(fetch(client, PLAIN))
    assert isinstance(first, Message) and number(first.item) == 0
    # One fetch moved one batch, no more: a huge due backlog cannot stall a fetch.
    assert client.llen(PLAIN) == ETA_BATCH - 1
    assert store.scheduled(client, names) == extra + 5

    served = [0]
    while True:
        reply = decode_fetch(fetch(client, PLAIN))
        if isinstance(reply, Idle):
            break
        assert isinstance(reply, Message)
        served.append(number(reply.item))
    assert served == list(range(ETA_BATCH + extra)), "each due message once, in due order"
    assert store.scheduled(client, names) == 5
    # Idle, the fetch says when the next scheduled message is due (about an hour).
    assert isinstance(reply, Idle) and reply.due is not None and 3500 < reply.due <= 3600
    assert client.hlen("unacked") == ETA_BATCH + extra


def test_promotion_keeps_the_priority_level_of_a_plain_message(client: Any) -> None:
    names = KeyedNames(PLAIN, SEP)
    store.schedule(client, names, time.time() - 1, payload(1), level=f"{SEP}3")
    assert store.promote(client, names, limit=10) == (1, 0)
    assert client.llen(PLAIN + f"{SEP}3") == 1 and client.llen(PLAIN) == 0


def test_a_keyed_message_comes_due_in_its_keys_list_and_is_served_fairly(client: Any) -> None:
    names = KeyedNames(KEYED, SEP)
    past = time.time() - 10
    for n in range(6):
        store.schedule(client, names, past + n * 0.001, payload(n), key="a")
    store.schedule(client, names, past + 1, payload(100), key="b")
    store.schedule(client, names, time.time() + 3600, payload(200), key="b")
    assert store.scheduled_keys(client, names, 10) == (("a", 6), ("b", 2))
    # The standalone script moves at most its limit, due ones only.
    assert store.promote(client, names, limit=4) == (4, 4)
    assert store.scheduled_keys(client, names, 10) == (("b", 2), ("a", 2))
    assert store.promote(client, names, limit=100) == (3, 1)
    # Each key's count goes with its last scheduled message.
    assert store.scheduled_keys(client, names, 10) == (("b", 1),)
    # The keyed publish's bookkeeping: the key's list, its size, its place in line.
    assert client.llen(names.key_list("a")) == 6 and client.llen(names.key_list("b")) == 1
    assert client.zscore(names.sizes, "a") == 6 and client.zscore(names.sizes, "b") == 1
    assert {k.decode() for k in client.zrange(names.active, 0, -1)} == {"a", "b"}
    keys = []
    for _ in range(4):
        reply = decode_fetch(fetch(client, KEYED, "1"))
        assert isinstance(reply, KeyedMessage)
        keys.append(reply.fair_key)
    # Served in fair order from when they came due: b is not behind all of a's.
    assert "b" in keys[:2], keys


def test_a_key_at_its_backlog_cap_refuses_a_scheduled_publish(client: Any) -> None:
    names = KeyedNames(KEYED, SEP)
    for n in range(2):
        store.enqueue(client, names, "a", payload(n))
    reply = store.schedule(client, names, time.time() + 60, payload(9), key="a", cap=2)
    assert store.refused(reply) == 2
    assert store.scheduled(client, names) == 0
    reply = store.schedule(client, names, time.time() + 60, payload(9), key="b", cap=2)
    assert store.refused(reply) is None and store.scheduled(client, names) == 1


def test_a_past_eta_is_not_scheduled_and_a_naive_one_is_read_in_the_apps_timezone() -> None:
    assert due_time("2030-01-01T00:00:00+00:00") == 1893456000.0
    assert due_time("2030-01-01T01:00:00+01:00") == 1893456000.0
    assert due_time("2030-01-01T00:00:00", "UTC") == 1893456000.0
    assert due_time(None) is None and due_time("not a date") is None


# -- the real worker -------------------------------------------------------------

COUNT = 10
#: Long enough for the worker to answer ``inspect`` while every task still waits.
COUNTDOWN = 8.0


def _producer(redis_url: str, keys: str | None) -> Celery:
    app = Celery("sched_producer", broker=redis_url, set_as_current=False)
    app.conf.fair_eta = "broker"
    if keys:
        queue, spec = keys.split("=", 1)
        app.conf.fair_keys = {queue: spec}
    celery_fair.install(app)
    return app


def _runs(ledger: Any) -> list[dict[str, Any]]:
    return [json.loads(r) for r in ledger.lrange("sched.ran", 0, -1)]


def _worker(redis_url: str, queue: str, keys: str | None) -> WorkerProcess:
    env = {"SCHED_ETA": "broker", "SCHED_LEDGER": redis_url}
    if keys:
        env["SCHED_KEYS"] = keys
    return WorkerProcess(
        redis_url, [queue], concurrency=2, app="tests.integration.scheduled_app", env=env
    )


@pytest.mark.parametrize(("queue", "keys"), [(PLAIN, None), (KEYED, f"{KEYED}=tenant_id")])
def test_countdown_tasks_wait_on_the_broker_and_run_once_not_early(
    redis_url: str, queue: str, keys: str | None
) -> None:
    ledger = redis.Redis.from_url(redis_url)
    producer = _producer(redis_url, keys)
    worker = _worker(redis_url, queue, keys).start()
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        sent = time.time()
        for n in range(COUNT):
            producer.send_task(
                "sched.record", args=[n], kwargs={"tenant_id": f"t{n % 3}"},
                countdown=COUNTDOWN, queue=queue,
            )  # fmt: skip
        names = KeyedNames(queue, SEP)
        assert store.scheduled(ledger, names) == COUNT
        # While they wait, the worker holds none of them.
        inspect = producer.control.inspect(timeout=2.0)
        scheduled, reserved = inspect.scheduled(), inspect.reserved()
        still_waiting = store.scheduled(ledger, names)
        assert scheduled and reserved, "the worker answered inspect"
        assert all(not tasks for tasks in scheduled.values()), scheduled
        assert all(not tasks for tasks in reserved.values()), reserved
        assert still_waiting == COUNT, "inspected while every task still waited"
        # The worker's own count of what waits on the broker for its queues.
        assert wait_fair_stats(redis_url)["scheduled"] == {queue: COUNT}
        assert time.time() - sent < COUNTDOWN, "inspected before any task was due"
        assert _runs(ledger) == []

        assert poll_until(lambda: ledger.llen("sched.ran") >= COUNT, COUNTDOWN + 60), worker.log()
        # No second run of any (a late duplicate would come within the visibility
        # timeout, an hour here: its absence is checked where it is short, later).
        runs = _runs(ledger)
        assert Counter(r["n"] for r in runs) == Counter(range(COUNT)), runs
        for r in runs:
            eta = due_time(r["eta"])
            assert eta is not None and r["due"] == pytest.approx(eta)
            assert r["start"] >= eta, f"task {r['n']} started {eta - r['start']:.3f}s early"
        assert store.scheduled(ledger, names) == 0
        if keys:
            assert ledger.zcard(names.sizes) == 0, "the keyed backlog is empty again"
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


def test_a_retry_countdown_waits_on_the_broker(redis_url: str) -> None:
    ledger = redis.Redis.from_url(redis_url)
    producer = _producer(redis_url, None)
    worker = _worker(redis_url, PLAIN, None).start()
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        producer.send_task("sched.retry_later", args=[7, COUNTDOWN], queue=PLAIN)
        assert poll_until(lambda: ledger.llen("sched.ran") >= 1, 60), worker.log()
        # The retry, sent by the worker itself, waits in the queue's schedule.
        names = KeyedNames(PLAIN, SEP)
        assert poll_until(lambda: store.scheduled(ledger, names) == 1, 10), worker.log()
        reserved = producer.control.inspect(timeout=2.0).scheduled()
        assert reserved and all(not tasks for tasks in reserved.values()), reserved
        assert poll_until(lambda: ledger.llen("sched.ran") >= 2, COUNTDOWN + 60), worker.log()
        first, second = _runs(ledger)
        assert (first["retries"], second["retries"]) == (0, 1)
        assert first["due"] is None, "the first run had no eta"
        eta = due_time(second["eta"])
        assert eta is not None and second["due"] == pytest.approx(eta)
        assert second["start"] >= eta >= first["start"] + COUNTDOWN - 1
        assert store.scheduled(ledger, names) == 0
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


# -- two-level keys, a queue moved back to plain lists, the move back, the counts -----


def test_a_two_level_keyed_message_comes_due_in_its_users_list(client: Any) -> None:
    names = KeyedNames(KEYED, SEP)
    store.schedule(client, names, time.time() - 1, payload(1), key="t", user="u1")
    assert store.promote(client, names, limit=10) == (1, 0)
    assert client.llen(names.user_list("t", "u1")) == 1
    assert [u.decode() for u in client.zrange(names.users("t"), 0, -1)] == ["u1"]
    assert client.zscore(names.active, "t") is not None


def test_a_keyed_message_comes_due_in_kombus_list_once_the_queue_is_unkeyed(client: Any) -> None:
    names = KeyedNames(KEYED, SEP)
    client.hset(names.state, "unkeyed", 1)  # as celery-fair keys unkey leaves it
    store.schedule(client, names, time.time() - 1, payload(1), key="a")
    assert store.promote(client, names, limit=10) == (1, 0)
    assert client.llen(KEYED) == 1 and client.llen(names.key_list("a")) == 0


def _cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "keys", *args, "-b", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_unschedule_moves_every_scheduled_message_in_and_backlog_counts_them(
    redis_url: str, client: Any
) -> None:
    from kombu import Connection

    from celery_fair.monitoring.exporter import families
    from celery_fair.monitoring.readings import read_redis

    plain, keyed = KeyedNames(PLAIN, SEP), KeyedNames(KEYED, SEP)
    later = time.time() + 3600
    for n in range(5):
        store.schedule(client, plain, later + n, payload(n))
    for n in range(3):
        store.schedule(client, keyed, later + n, payload(n), key="a")
    store.schedule(client, keyed, later, payload(9), key="b")
    shown = _cli(redis_url, "backlog", PLAIN, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["scheduled"] == 5
    shown = _cli(redis_url, "backlog", KEYED, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["scheduled_keys"] == {"a": 3, "b": 1}
    with Connection(redis_url) as connection:
        readings = {r.queue: r for r in read_redis(connection.default_channel, [PLAIN, KEYED])}
    assert (readings[PLAIN].scheduled, readings[PLAIN].backlog) == (5, 0)
    assert (readings[KEYED].scheduled, readings[KEYED].backlog) == (4, 0)
    assert readings[KEYED].scheduled_keys == (("a", 3), ("b", 1))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families(list(readings.values()))
        for s in family.samples
    }
    assert samples[("celery_fair_queue_scheduled", (("queue", KEYED),))] == 4
    assert samples[("celery_fair_key_scheduled", (("key", "a"), ("queue", KEYED)))] == 3

    moved = _cli(redis_url, "unschedule", PLAIN, "--batch", "2")
    assert moved.returncode == 0, moved.stderr
    assert "5 scheduled message(s) moved" in moved.stdout
    assert client.llen(PLAIN) == 5 and store.scheduled(client, plain) == 0
    moved = _cli(redis_url, "unschedule", KEYED)
    assert moved.returncode == 0, moved.stderr
    assert client.llen(keyed.key_list("a")) == 3 and store.scheduled(client, keyed) == 0
    assert store.scheduled_keys(client, keyed, 10) == ()
    # In publish order within the plain queue (LPUSH, fetched from the other end).
    assert [number(client.rpop(PLAIN)) for _ in range(5)] == list(range(5))


def test_celery_purge_deletes_the_schedule_too(redis_url: str, client: Any) -> None:
    from kombu import Connection

    from celery_fair.keys.publish import wrap_kombu

    wrap_kombu()  # as install() does for an app with fair_eta="broker"
    for n in range(3):
        store.schedule(client, KeyedNames(PLAIN, SEP), time.time() + 3600, payload(n))
    client.lpush(PLAIN, payload(9))
    keyed = KeyedNames(KEYED, SEP)
    store.schedule(client, keyed, time.time() + 3600, payload(5), key="a")
    with Connection(redis_url) as connection:
        assert connection.default_channel.queue_purge(PLAIN) == 4
        assert connection.default_channel.queue_purge(KEYED) == 1
    assert store.scheduled(client, KeyedNames(PLAIN, SEP)) == 0 and client.llen(PLAIN) == 0
    assert store.scheduled(client, keyed) == 0 and not client.exists(keyed.scheduled_keys)


def test_a_task_that_expired_while_it_waited_is_discarded_when_due(redis_url: str) -> None:
    ledger = redis.Redis.from_url(redis_url)
    producer = _producer(redis_url, None)
    worker = _worker(redis_url, PLAIN, None).start()
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        result = producer.send_task("sched.record", args=[1], countdown=4, expires=1, queue=PLAIN)
        assert store.scheduled(ledger, KeyedNames(PLAIN, SEP)) == 1
        assert poll_until(lambda: ledger.llen("sched.revoked") >= 1, 60), worker.log()
        revoked = [json.loads(r) for r in ledger.lrange("sched.revoked", 0, -1)]
        assert revoked == [{"id": result.id, "expired": True}]
        assert _runs(ledger) == [] and store.scheduled(ledger, KeyedNames(PLAIN, SEP)) == 0
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


#: Past the visibility timeout: Kombu restores what a worker holds unacknowledged longer.
VISIBILITY, LONG_COUNTDOWN = 3.0, 8.0


@pytest.mark.parametrize(("queue", "keys"), [(PLAIN, None), (KEYED, f"{KEYED}=tenant_id")])
def test_past_the_visibility_timeout_each_scheduled_task_runs_once(
    redis_url: str, queue: str, keys: str | None
) -> None:
    ledger = redis.Redis.from_url(redis_url)
    producer = _producer(redis_url, keys)
    worker = _worker(redis_url, queue, keys)
    worker.env = {**worker.env, "SCHED_VISIBILITY": str(VISIBILITY)}
    worker.start()
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        for n in range(COUNT):
            producer.send_task(
                "sched.record", args=[n], kwargs={"tenant_id": f"t{n % 3}"},
                countdown=LONG_COUNTDOWN, queue=queue,
            )  # fmt: skip
        assert poll_until(lambda: ledger.llen("sched.ran") >= COUNT, LONG_COUNTDOWN + 60)
        # Nothing left unacknowledged, so nothing left that Kombu could restore and run again.
        assert poll_until(lambda: ledger.hlen("unacked") == 0, 30), worker.log()
        runs = Counter(r["n"] for r in _runs(ledger))
        assert runs == Counter(range(COUNT)), runs
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


def test_plain_celery_runs_a_task_held_past_the_visibility_timeout_again(redis_url: str) -> None:
    """The anchor: the same tasks with Celery's behaviour (no celery-fair) run more than once."""
    ledger = redis.Redis.from_url(redis_url)
    producer = Celery("sched_plain_producer", broker=redis_url, set_as_current=False)
    worker = WorkerProcess(
        redis_url, [PLAIN], concurrency=2, app="tests.integration.scheduled_app",
        env={"SCHED_FAIR": "0", "SCHED_LEDGER": redis_url, "SCHED_VISIBILITY": str(VISIBILITY)},
    ).start()  # fmt: skip
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        for n in range(COUNT):
            producer.send_task("sched.record", args=[n], countdown=LONG_COUNTDOWN, queue=PLAIN)

        def repeated() -> bool:
            return any(c > 1 for c in Counter(r["n"] for r in _runs(ledger)).values())

        assert poll_until(repeated, LONG_COUNTDOWN + 60), _runs(ledger)
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


@pytest.mark.rabbitmq
def test_on_rabbitmq_the_worker_says_so_and_celerys_behaviour_stays(
    redis_url: str, rabbitmq_server: Any
) -> None:
    """``fair_eta="broker"`` on RabbitMQ: one line at start, and the worker holds the task."""
    ledger = redis.Redis.from_url(redis_url)
    queue = f"sched-{uuid.uuid4().hex[:8]}"
    producer = _producer(rabbitmq_server.url, None)
    worker = WorkerProcess(
        rabbitmq_server.url, [queue], concurrency=2, app="tests.integration.scheduled_app",
        env={"SCHED_ETA": "broker", "SCHED_LEDGER": redis_url},
    ).start()  # fmt: skip
    try:
        assert poll_until(lambda: " ready." in worker.log(), 90), worker.log()
        assert worker.log().count("applies to the Redis broker only") == 1, worker.log()
        producer.send_task("sched.record", args=[1], countdown=COUNTDOWN, queue=queue)

        def held() -> int:
            replies = producer.control.inspect(timeout=2.0).scheduled() or {}
            return sum(len(tasks) for tasks in replies.values())

        # Celery's behaviour: the worker holds the task until its eta.
        assert poll_until(lambda: held() == 1, COUNTDOWN), worker.log()
        assert poll_until(lambda: ledger.llen("sched.ran") >= 1, COUNTDOWN + 60), worker.log()
        (run,) = _runs(ledger)
        eta = due_time(run["eta"])
        assert eta is not None and run["start"] >= eta
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


def test_rolling_back_to_plain_workers_with_unschedule_runs_every_task_once(
    redis_url: str,
) -> None:
    """docs/migrating.md's order back: producers, ``keys unschedule``, plain workers.

    A plain Celery worker never looks at the schedule: the tasks wait there
    past their eta until the move, then the plain worker holds the ones not
    yet due until their eta, as Celery does, and runs each once.
    """
    ledger = redis.Redis.from_url(redis_url)
    producer = _producer(redis_url, None)
    names = KeyedNames(PLAIN, SEP)
    for n in range(COUNT):
        # Half already due when the move comes, half still to come after it.
        producer.send_task("sched.record", args=[n], countdown=2 if n % 2 else 15, queue=PLAIN)
    assert store.scheduled(ledger, names) == COUNT
    worker = WorkerProcess(
        redis_url, [PLAIN], concurrency=2, app="tests.integration.scheduled_app",
        env={"SCHED_FAIR": "0", "SCHED_LEDGER": redis_url},
    ).start()  # fmt: skip
    try:
        assert poll_until(lambda: " ready." in worker.log(), 60), worker.log()
        # Past the first etas, the plain worker has run none: they wait on the broker.
        first_due = min(due for _, due in ledger.zrange(names.schedule, 0, 0, withscores=True))
        assert poll_until(lambda: time.time() > first_due + 2, 30)
        assert _runs(ledger) == [] and store.scheduled(ledger, names) == COUNT

        last_due = max(due for _, due in ledger.zrange(names.schedule, -1, -1, withscores=True))
        moved = _cli(redis_url, "unschedule", PLAIN)
        assert moved.returncode == 0, moved.stderr
        assert store.scheduled(ledger, names) == 0
        assert time.time() < last_due, "some were moved before they were due"
        assert poll_until(lambda: ledger.llen("sched.ran") >= COUNT, 60), worker.log()
        runs = _runs(ledger)
        assert Counter(r["n"] for r in runs) == Counter(range(COUNT)), runs
        for r in runs:
            eta = due_time(r["eta"])
            assert eta is not None and r["start"] >= eta, r
    finally:
        worker.stop(QUICK_STOP)  # the test is over: a warm stop's wait buys nothing


def test_only_a_message_due_before_every_other_touches_what_idle_fetches_watch(
    client: Any,
) -> None:
    """Idle fetches watch ``schedule_next``: a message due later than the next changes
    nothing for them (they wake when the next is due), so it must not wake them."""
    names = KeyedNames(PLAIN, SEP)
    now = time.time()
    store.schedule(client, names, now + 60, payload(1))
    assert float(client.get(names.schedule_next)) == pytest.approx(now + 60)

    def untouched_while(action: Any) -> bool:
        """Whether ``action`` left the watched key unwritten (WATCH sees any write)."""
        with client.pipeline() as pipe:
            pipe.watch(names.schedule_next)
            action()
            pipe.multi()
            pipe.get(names.schedule_next)
            try:
                pipe.execute()
            except redis.WatchError:
                return False
            return True

    # Later than the next: no write to the watched key.
    assert untouched_while(lambda: store.schedule(client, names, now + 120, payload(2)))
    assert float(client.get(names.schedule_next)) == pytest.approx(now + 60)
    # Sooner: written, so the watchers wake.
    assert not untouched_while(lambda: store.schedule(client, names, now + 30, payload(9)))
    assert float(client.get(names.schedule_next)) == pytest.approx(now + 30)
    assert store.scheduled(client, names) == 3
