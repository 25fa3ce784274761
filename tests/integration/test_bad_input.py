"""Bad input on both brokers: parked with a reason or sent back, never dropped.

Real ``celery worker`` processes of two releases of one app
(:mod:`tests.integration.rolling_app`) against a real Redis and RabbitMQ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue

from celery_fair.parking.store import parking_for
from tests.harness.harness import WorkerProcess

pytestmark = pytest.mark.integration

APP = "tests.integration.rolling_app"
BROKERS = [
    pytest.param("redis", marks=pytest.mark.compat),
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
]


def _url(request: pytest.FixtureRequest, broker: str) -> str:
    server = request.getfixturevalue("redis_server" if broker == "redis" else "rabbitmq_server")
    return str(server.url)


def _worker(url: str, ledger: str, queue: str, release: str, **env: str) -> WorkerProcess:
    return WorkerProcess(
        url, [queue], concurrency=2, app=APP, fair=env.pop("fair", "1") == "1",
        env={"ROLLING_RELEASE": release, "ROLLING_LEDGER": ledger, **env},
        name=f"{release}-{uuid.uuid4().hex[:6]}",
    ).start()  # fmt: skip


def _until(what: Callable[[], Any], message: Callable[[], str], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, message()
        time.sleep(0.05)


def _alive(*workers: WorkerProcess) -> None:
    for worker in workers:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]


def _publish_tasks(url: str, queue: str, task: str, count: int) -> None:
    app = Celery("producer", broker=url, set_as_current=False)
    with app.producer_or_acquire() as producer:
        for n in range(count):
            app.send_task(task, args=(n,), queue=queue, producer=producer)


def _ran(ledger: str, task: str) -> set[int]:
    return {int(n) for n in redis_lib.Redis.from_url(ledger).smembers(f"ran:{task}")}


def _ran_by(ledger: str) -> dict[str, int]:
    raw = redis_lib.Redis.from_url(ledger).hgetall("ran:by")
    return {k.decode(): int(v) for k, v in raw.items()}


def _rolling(url: str, ledger: str, queue: str, *, fair: bool, n: int) -> tuple[int, str]:
    """An old worker without ``new_task`` is running; ``n`` new tasks arrive, then a new worker.

    Returns how many ``new_task`` runs were lost and the old worker's log.
    """
    flag = "1" if fair else "0"
    old = _worker(url, ledger, queue, "old", fair=flag)
    new = None
    try:
        _until(lambda: "ready." in old.log(), lambda: old.log()[-3000:])
        _publish_tasks(url, queue, "new_task", n)
        # The old worker has met the new task before the new worker starts.
        seen = "does not know task 'new_task'" if fair else "unregistered task of type 'new_task'"
        _until(lambda: seen in old.log(), lambda: old.log()[-3000:])
        new = _worker(url, ledger, queue, "new", fair=flag)
        if fair:
            _until(lambda: len(_ran(ledger, "new_task")) == n or _alive(old, new),
                   lambda: f"{len(_ran(ledger, 'new_task'))} of {n} ran")  # fmt: skip
        else:
            # Plain Celery logs each message it drops: done when every message
            # either ran or was dropped.
            def settled() -> bool:
                dropped = old.log().count("unregistered task of type 'new_task'")
                return len(_ran(ledger, "new_task")) + dropped >= n

            _until(settled, lambda: old.log()[-3000:])
        log = old.log()
    finally:
        old.stop()
        if new is not None:
            new.stop()
    return n - len(_ran(ledger, "new_task")), log


@pytest.mark.parametrize("broker", BROKERS)
def test_rolling_deploy_loses_nothing(
    request: pytest.FixtureRequest, redis_url: str, broker: str, record_property: Any
) -> None:
    url, n = _url(request, broker), 500
    lost, log = _rolling(url, redis_url, f"roll-{uuid.uuid4().hex[:8]}", fair=True, n=n)
    assert lost == 0
    by = _ran_by(redis_url)
    assert by == {"new_task:new": n}, by  # every run on the new release; none twice
    assert "sent back to queue" in log
    redis_lib.Redis.from_url(redis_url).delete("ran:new_task", "ran:by")
    plain_lost, _ = _rolling(url, redis_url, f"roll-{uuid.uuid4().hex[:8]}", fair=False, n=n)
    record_property("plain_celery_lost", plain_lost)
    print(f"\nrolling deploy on {broker}: celery-fair lost 0 of {n}, plain lost {plain_lost}")
    assert plain_lost > 0  # what celery-fair prevents: plain Celery drops them


def _publish_bad(url: str, queue: str, redis_list: str | None) -> int:
    """Publish one of each kind of bad input; returns how many."""
    exchange = Exchange(queue, "direct")
    target = Queue(queue, exchange, routing_key=queue)
    with Connection(url) as conn:
        producer = Producer(conn.default_channel)

        def publish(body: Any, content_type: str, headers: dict[str, Any]) -> None:
            producer.publish(
                body, exchange=exchange, routing_key=queue, declare=[target],
                content_type=content_type, content_encoding="utf-8", headers=headers,
            )  # fmt: skip

        task = {"task": "old_task", "id": str(uuid.uuid4())}
        publish('{"args": [1], not json', "application/json", {**task, "lang": "py"})
        publish("whatever", "application/x-bogus", {**task, "id": str(uuid.uuid4())})
        publish('"hello"', "application/json", {})  # not a task message at all
    if redis_list is None:
        return 3
    redis_lib.Redis.from_url(url).lpush(redis_list, b"this is not json")  # no delivery tag
    return 4


@pytest.mark.parametrize("broker", BROKERS)
def test_bad_input_is_parked_and_replayed(
    request: pytest.FixtureRequest, redis_url: str, broker: str
) -> None:
    url = _url(request, broker)
    queue = f"bad-{uuid.uuid4().hex[:8]}"
    old = _worker(url, redis_url, queue, "old", ROLLING_MAX_RETURNS="0")
    try:
        _until(lambda: "ready." in old.log(), lambda: old.log()[-3000:])
        bad = _publish_bad(url, queue, queue if broker == "redis" else None)
        _publish_tasks(url, queue, "old_task", 20)
        _publish_tasks(url, queue, "new_task", 3)  # unknown here: parked at once (cap 0)
        with Connection(url) as conn:
            parking = parking_for(conn.default_channel)
            parked = _until(
                lambda: p if len(p := parking.list(queue)) == bad + 3 else None,
                lambda: f"{len(parking.list(queue))} parked; " + old.log()[-3000:],
            )
        _until(lambda: len(_ran(redis_url, "old_task")) == 20, lambda: old.log()[-3000:])
        _alive(old)
        log = old.log()
    finally:
        old.stop()
    reasons = sorted(p.reason.split(":")[0] for p in parked)
    expected = ["body does not decode", "invalid or not accepted"]
    expected.append("not a task message (no task name)")
    expected += ["unknown task 'new_task'"] * 3
    if broker == "redis":
        expected.append("not a Kombu message (no delivery tag)")
    assert reasons == sorted(expected)
    assert all(p.parked_at is not None and p.queue == queue for p in parked)
    assert sorted(p.task for p in parked if p.task == "new_task") == ["new_task"] * 3
    assert f"message of queue {queue!r} parked in" in log  # one line per message
    assert _ran(redis_url, "new_task") == set()

    # The fix is deployed (a worker that knows new_task); the operator replays.
    listed = _cli(url, queue, "--json")
    assert len(listed) == bad + 3 and all(row["age"] is not None for row in listed)
    new = _worker(url, redis_url, queue, "new", ROLLING_MAX_RETURNS="0")
    try:
        _until(lambda: "ready." in new.log(), lambda: new.log()[-3000:])
        out = _cli_text(url, queue, "--replay")
        assert out.startswith(f"{bad + 3} message(s) put back")
        _until(lambda: _ran(redis_url, "new_task") == {0, 1, 2}, lambda: new.log()[-3000:])
        with Connection(url) as conn:
            parking = parking_for(conn.default_channel)
            # The bad ones are still bad: parked again, with their reasons.
            _until(lambda: len(parking.list(queue)) == bad, lambda: new.log()[-3000:])
        _alive(new)
    finally:
        new.stop()
    assert _cli_text(url, queue, "--purge").startswith(f"{bad} message(s) dropped")
    assert _cli(url, queue, "--json") == []


def _cli_text(url: str, queue: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "parked", queue, "--broker", url, *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cli(url: str, queue: str, *args: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _cli_text(url, queue, *args).splitlines()]


@pytest.mark.compat
def test_parking_honours_a_global_key_prefix(redis_url: str) -> None:
    prefix, queue = "tenant-a:", f"bad-{uuid.uuid4().hex[:8]}"
    old = _worker(redis_url, redis_url, queue, "old", ROLLING_MAX_RETURNS="0",
                  ROLLING_KEYPREFIX=prefix)  # fmt: skip
    client = redis_lib.Redis.from_url(redis_url)
    try:
        _until(lambda: "ready." in old.log(), lambda: old.log()[-3000:])
        app = Celery("producer", broker=redis_url, set_as_current=False)
        app.conf.broker_transport_options = {"global_keyprefix": prefix}
        app.send_task("new_task", args=(7,), queue=queue)
        client.lpush(prefix + queue, b"this is not json")
        parked = prefix + queue + ".fair-malformed"
        _until(lambda: client.llen(parked) == 2, lambda: old.log()[-3000:])
    finally:
        old.stop()
    cli = [sys.executable, "-m", "celery_fair.cli", "parked", queue, "-A", APP, "--json"]
    env = {**os.environ, "CELERY_FAIR_BROKER": redis_url, "ROLLING_KEYPREFIX": prefix}
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env, check=True)
    reasons = sorted(json.loads(line)["reason"].split(":")[0] for line in done.stdout.splitlines())
    assert reasons == ["not a Kombu message (no delivery tag)", "unknown task 'new_task'"]
    assert not [k for k in client.scan_iter() if k.startswith((prefix * 2).encode())]
