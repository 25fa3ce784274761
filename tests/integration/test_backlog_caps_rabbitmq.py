"""Backlog caps (``fair_key_max_backlog``) on a real RabbitMQ, with the real ``celery worker``.

The producer counts a capped key's tasks in the key's counter queue, which the
broker refuses to fill past the cap; the worker frees a place as it receives a
task (:mod:`celery_fair.keys.backlog_counter`).  Workers start with Celery's
defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest
from amqp.exceptions import NotFound
from kombu.connection import Connection

import celery_fair
from celery_fair.keys.lanes import KeyLanes
from tests.harness.control import wait_fair_stats
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.keys import keyed_app
from tests.harness.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture
def queue() -> str:
    return f"capped-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def amqp_url(rabbitmq_server: Any) -> str:
    return str(rabbitmq_server.url)


def _waiting(url: str, queue: str) -> int:
    """Messages waiting in keyed ``queue`` and all its lanes."""
    names = (queue, *KeyLanes(frozenset({queue})).lanes(queue))
    total = 0
    with Connection(url) as conn:
        for name in names:
            channel = conn.channel()
            try:
                total += int(channel.queue_declare(name, passive=True).message_count)
            except NotFound:  # a lane no task took (RabbitMQ closed the channel)
                continue
            channel.close()
    return total


def _counted(url: str, queue: str, key: str, cap: int) -> int:
    with Connection(url) as conn:
        name = KeyLanes.backlog_counter(queue, key, cap)
        return int(conn.default_channel.queue_declare(name, passive=True).message_count)


def test_a_cap_refuses_exactly_the_excess_with_concurrent_producers_on_rabbitmq(
    amqp_url: str, queue: str
) -> None:
    refused: list[celery_fair.KeyBacklogFull] = []
    lock = threading.Lock()
    caps = {"*": 1000, "capped": 100}

    def produce() -> None:
        app = keyed_app(amqp_url, {queue: "tenant_id"}, fair_key_max_backlog=caps)
        try:
            with app.producer_or_acquire() as producer:
                for _ in range(60):
                    try:
                        app.send_task("ledger", kwargs={"tenant_id": "capped"}, queue=queue,
                                      producer=producer)  # fmt: skip
                    except celery_fair.KeyBacklogFull as exc:
                        with lock:
                            refused.append(exc)
                    app.send_task("ledger", kwargs={"tenant_id": "other"}, queue=queue,
                                  producer=producer)  # fmt: skip
        finally:
            app.close()

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(refused) == 4 * 60 - 100
    # What waits: the capped key's 100 and the other key's 240 (under the "*" cap).
    assert _waiting(amqp_url, queue) == 100 + 240
    assert _counted(amqp_url, queue, "capped", 100) == 100
    assert _counted(amqp_url, queue, "other", 1000) == 240
    err = refused[0]
    assert (err.queue, err.key, err.cap, err.backlog) == (queue, "capped", 100, 100)
    assert "fair_key_max_backlog" in str(err) and "'capped'" in str(err)


def test_a_worker_frees_the_places_of_what_it_receives_on_rabbitmq(
    amqp_url: str, redis_url: str, queue: str
) -> None:
    """A full key, then a worker: every task it receives frees its place (a task
    with a countdown as it arrives), a task that expires in the broker takes its
    marker with it, one revoked before it arrives frees its place as Celery drops
    it, and the key takes its cap again."""
    ledger = Ledger(redis_url)
    ledger.reset()
    app = keyed_app(amqp_url, {queue: "tenant_id"}, fair_key_max_backlog={"a": 20})
    try:
        for _ in range(18):
            app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue)
        app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue, countdown=2)
        # Celery gives it a time to live in RabbitMQ, which drops it unreceived.
        app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue, expires=0.2)
        with pytest.raises(celery_fair.KeyBacklogFull):
            app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue)
        assert _counted(amqp_url, queue, "a", 20) == 20
        env = {"CELERY_FAIR_KEYS": f"{queue}=tenant_id", "CELERY_FAIR_LEDGER": redis_url}
        with WorkerProcess(amqp_url, [queue], concurrency=2, env=env) as worker:
            assert ledger.wait_for(19, timeout=120, alive=[worker]), worker.log()[-3000:]
            assert poll_until(lambda: _counted(amqp_url, queue, "a", 20) == 0, timeout=30), (
                _counted(amqp_url, queue, "a", 20),
                worker.log()[-3000:],
            )
            for _ in range(20):
                app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue)
            assert ledger.wait_for(39, timeout=120, alive=[worker]), worker.log()[-3000:]
            # Revoked before it arrives: Celery drops it at receipt, which frees its place.
            revoked = str(uuid.uuid4())
            assert app.control.revoke(revoked, reply=True, timeout=5)
            app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue, task_id=revoked)
            assert poll_until(lambda: _counted(amqp_url, queue, "a", 20) == 0, timeout=30)
            stats = wait_fair_stats(amqp_url)
        assert ledger.count() == 39
    finally:
        app.close()
    counters = stats["keys"]["backlog_counters"]
    # 19 + 20 received and one revoked; the expired task's marker expired with it.
    assert counters["released"] == 40 and counters["errors"] == 0, counters


def test_a_copy_sent_back_is_not_counted_again_on_rabbitmq(amqp_url: str, queue: str) -> None:
    """CoDel or a pause send a received task back as a copy: the original freed its
    place as it arrived, and the copy, never counted, carries no cap that would free
    another task's place."""
    from kombu import Exchange, Producer
    from kombu import Queue as KombuQueue

    from celery_fair.kombu.requeue import return_copy
    from celery_fair.wire import KEY_HEADER, MAX_BACKLOG_HEADER

    declared = KombuQueue(queue, Exchange(""), routing_key=queue, durable=False)
    with Connection(amqp_url) as conn:
        channel = conn.channel()
        Producer(channel).publish(
            {"x": 1}, exchange="", routing_key=queue, declare=[declared],
            headers={KEY_HEADER: "a", MAX_BACKLOG_HEADER: 20}, serializer="json",
        )  # fmt: skip
        got: list[Any] = []

        def take(**kwargs: Any) -> bool:
            message = declared(channel).get(**kwargs)
            if message is not None:
                got.append(message)
            return message is not None

        assert poll_until(take, timeout=10)
        original = got.pop()
        return_copy(original, queue, {"fair_requeues": 1}, front=False)
        original.ack()
        assert poll_until(lambda: take(no_ack=True), timeout=10)
        copy = got.pop()
        # An unknown task goes back unreceived: its place is still taken, the copy keeps it.
        return_copy(copy, queue, {MAX_BACKLOG_HEADER: 20}, front=False)
        assert poll_until(lambda: take(no_ack=True), timeout=10)
        unreceived = got.pop()
    assert copy.headers[KEY_HEADER] == "a" and copy.headers["fair_requeues"] == 1
    assert MAX_BACKLOG_HEADER not in copy.headers
    assert copy.payload == {"x": 1}
    assert unreceived.headers[MAX_BACKLOG_HEADER] == 20


def test_tasks_redelivered_after_a_crash_free_no_second_place_on_rabbitmq(
    amqp_url: str, redis_url: str, queue: str
) -> None:
    """A worker killed with SIGKILL holding capped tasks: the broker delivers them again
    to the next worker, which frees no place for them (they freed theirs on their first
    delivery), so the counter again holds exactly the tasks that wait."""
    cap, tasks = 100, 100
    app = keyed_app(amqp_url, {queue: "tenant_id"}, fair_key_max_backlog={"a": cap})
    # Long tasks on one process: each worker holds its windows' worth of tasks (a
    # shard lane's 34, a noisy lane's 4) while the test looks.
    env = {"CELERY_FAIR_KEYS": f"{queue}=tenant_id", "CELERY_FAIR_LEDGER": redis_url}

    def exact() -> bool:
        return _counted(amqp_url, queue, "a", cap) == _waiting(amqp_url, queue)

    try:
        for _ in range(tasks):
            app.send_task("ledger", kwargs={"tenant_id": "a", "ms": 4000}, queue=queue)
        first = WorkerProcess(amqp_url, [queue], concurrency=1, env=env).start()
        try:
            assert poll_until(
                lambda: _waiting(amqp_url, queue) <= tasks - 30 and exact(), timeout=60
            ), (_counted(amqp_url, queue, "a", cap), _waiting(amqp_url, queue))
        finally:
            first.kill()
        # What it held goes back (but the task it had started, acknowledged early):
        # more wait than are counted until the next worker receives them again.
        assert poll_until(
            lambda: _waiting(amqp_url, queue) > _counted(amqp_url, queue, "a", cap) + 20,
            timeout=30,
        )
        with WorkerProcess(amqp_url, [queue], concurrency=1, env=env) as second:
            assert poll_until(lambda: _waiting(amqp_url, queue) <= tasks - 31, timeout=60)
            assert poll_until(exact, timeout=30), (
                _counted(amqp_url, queue, "a", cap),
                _waiting(amqp_url, queue),
                second.log()[-3000:],
            )
            stats = wait_fair_stats(amqp_url)
    finally:
        app.close()
    counters = stats["keys"]["backlog_counters"]
    # The second worker received over 30 tasks, nearly all redelivered ones.
    assert counters["errors"] == 0 and counters["released"] < 10, counters


def test_durable_counts_outlive_a_broker_restart_as_their_tasks_do_on_rabbitmq() -> None:
    """With ``fair_key_max_backlog_durable`` a persistent task (Celery's default) is
    counted by a persistent marker, a transient one by a transient marker: after the
    broker restarts, the counter holds exactly the tasks that came back, and the cap
    still refuses the excess.  Without it (the default) the restart empties the
    counter while the tasks stay, as documented."""
    from tests.harness.rabbitmq import RabbitMQServer

    durable, default, cap = "capped-durable", "capped-default", 20
    with RabbitMQServer() as server:

        def app_for(queue: str) -> Any:
            return keyed_app(server.url, {queue: "tenant_id"}, fair_key_max_backlog={"a": cap},
                             fair_key_max_backlog_durable=queue == durable)  # fmt: skip

        for queue in (durable, default):
            app = app_for(queue)
            try:
                for _ in range(15):
                    app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue)
                for _ in range(3):  # transient: lost with their markers at the restart
                    app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=queue,
                                  delivery_mode=1)  # fmt: skip
            finally:
                app.close()
            assert (_waiting(server.url, queue), _counted(server.url, queue, "a", cap)) == (18, 18)
        server.restart()  # same port and data directory
        assert (_waiting(server.url, durable), _counted(server.url, durable, "a", cap)) == (15, 15)
        assert (_waiting(server.url, default), _counted(server.url, default, "a", cap)) == (15, 0)
        app = app_for(durable)
        try:
            for _ in range(cap - 15):
                app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=durable)
            with pytest.raises(celery_fair.KeyBacklogFull):
                app.send_task("ledger", kwargs={"tenant_id": "a"}, queue=durable)
        finally:
            app.close()
        assert _waiting(server.url, durable) == cap


def test_keys_backlog_shows_what_the_named_keys_counters_hold_on_rabbitmq(
    amqp_url: str, queue: str
) -> None:
    """``celery fair keys backlog QUEUE KEY... -A app``: each named key's count of
    waiting tasks and its cap, from the app's ``fair_key_max_backlog``."""
    caps = "a=20,b=50"
    app = keyed_app(amqp_url, {queue: "tenant_id"}, fair_key_max_backlog=caps)
    try:
        for key, n in (("a", 7), ("b", 3)):
            for _ in range(n):
                app.send_task("ledger", kwargs={"tenant_id": key}, queue=queue)
    finally:
        app.close()

    def keys_backlog(*more: str, app: str | None = "tests.harness.workload") -> Any:
        command = [sys.executable, "-m", "celery_fair.cli", "keys", "backlog", queue,
                   "a", "b", "c", *more, *(("-A", app) if app else ("-b", amqp_url))]  # fmt: skip
        # The workload app's broker and caps.
        env = {**os.environ, "CELERY_FAIR_BROKER": amqp_url, "CELERY_FAIR_KEY_MAX_BACKLOG": caps}
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    shown = keys_backlog("--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["messages"] == 10
    assert record["keys"] == {
        "a": {"cap": 20, "waiting": 7},
        "b": {"cap": 50, "waiting": 3},
        "c": {"cap": None, "waiting": None},
    }
    text = keys_backlog()
    assert "  a: 7 of 20" in text.stdout and "  b: 3 of 50" in text.stdout, text.stdout
    assert "  c: no cap" in text.stdout
    # Which keys are capped, and at what, is the producers' setting: the app must say.
    without = keys_backlog(app=None)
    assert without.returncode != 0 and "name the app (-A)" in without.stderr, without.stderr
