"""The atomic Redis fetch: pop and unacked record in one script, blocking waits kept."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

import pytest
import redis as redis_lib
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_fair.kombu.cycle import install_on_channel
from celery_fair.scheduling.scheduler import FairScheduler
from tests.harness.harness import WorkerProcess, fill_queues, wait_unacked_restorable
from tests.harness.redis import KOMBU_REPOLLS_AFTER_RESTART, RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.compat]


@pytest.fixture
def kombu_channel(redis_url: str) -> Iterator[tuple[Connection, Any]]:
    with Connection(redis_url) as conn:
        yield conn, conn.channel()


def test_the_fetch_writes_the_unacked_record_with_the_pop(
    kombu_channel: tuple[Connection, Any], redis_url: str
) -> None:
    conn, channel = kombu_channel
    client = redis_lib.Redis.from_url(redis_url)
    queues = [Queue(name, Exchange(name), routing_key=name) for name in ("ta", "tb")]
    producer = Producer(channel)
    for i in range(6):
        for q in queues:
            producer.publish({"n": i, "q": q.name}, exchange=q.exchange, routing_key=q.name,
                             declare=[q])  # fmt: skip
    seen: list[tuple[str, bool, bool]] = []

    def on_message(body: dict[str, Any], message: Any) -> None:
        tag = message.delivery_tag
        # At delivery, the message is already in Redis's unacked hash and index.
        record = client.hget("unacked", tag)
        indexed = client.zscore("unacked_index", tag) is not None
        seen.append((body["q"], record is not None, indexed))
        assert record is not None and json.loads(record)[0]["properties"]["delivery_tag"] == tag
        message.ack()

    scheduler = FairScheduler({"ta": 1, "tb": 2})
    consumer = Consumer(channel, queues, callbacks=[on_message])
    cycle = install_on_channel(channel, scheduler, atomic=True)
    assert cycle is not None and cycle.atomic is not None
    with consumer:
        deadline = time.monotonic() + 20
        while len(seen) < 12:
            assert time.monotonic() < deadline, seen
            conn.drain_events(timeout=5)
    assert all(recorded and indexed for _, recorded, indexed in seen)
    # Acknowledged: nothing left unacked; the fetch order is the DWRR order (tb weighs 2).
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    assert [q for q, _, _ in seen[:6]].count("tb") == 4
    assert cycle.atomic.fetches == 12


def test_an_idle_worker_is_woken_by_the_broker_not_by_a_timeout(redis_url: str) -> None:
    # The idle wait's server-side timeout is 60 s: a task published to the
    # idle worker runs long before that only if the invalidation woke it.
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_POLL": "60"}
    client = redis_lib.Redis.from_url(redis_url)
    # Without mingle: its last poll of its reply queue (a BRPOP with the same
    # 60 s timeout, sent before the fetch takes the channel over) would hold
    # the first fetch back for a minute, as in plain Celery.
    # A warm shutdown would wait out the 60 s wait in progress (plain Celery's
    # BRPOP as well: measured, both outlast the harness's 45 s stop): once the
    # figures are read, the worker is killed.
    worker = WorkerProcess(redis_url, ["idle"], env=env, extra_args=["--without-mingle"]).start()
    try:
        from tests.harness.control import control_app

        app = control_app(redis_url)

        def stats() -> dict[str, Any]:
            replies = app.control.inspect(timeout=3, limit=1)._request("fair_stats") or {}
            return next(iter(replies.values()), {})

        deadline = time.monotonic() + 30
        while not (stats().get("atomic_fetch") or {}).get("waits"):
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            assert time.monotonic() < deadline, "the worker never went idle"
            time.sleep(0.2)
        fill_queues(redis_url, {"idle": 1}, task="ledger", args=(0,))
        deadline = time.monotonic() + 30
        while client.llen("ledger") < 1:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.05)
        fetch = stats()["atomic_fetch"]
    finally:
        worker.kill()
    assert fetch["tracking"] is True
    assert fetch["wakeups"] >= 1 and fetch["fetches"] >= 1


def published_ids(client: redis_lib.Redis, queues: list[str]) -> set[str]:
    return {json.loads(raw)["headers"]["id"] for q in queues for raw in client.lrange(q, 0, -1)}


def ran_ids(ledger: redis_lib.Redis) -> set[str]:
    return {json.loads(e)["id"] for e in ledger.lrange("ledger", 0, -1)}


# Without KOMBU_REPOLLS_AFTER_RESTART the first worker below is killed without
# waiting for progress; the second must still run every task.


def test_broker_killed_mid_fetch_then_worker_killed_loses_nothing(redis_url: str) -> None:
    """The issue's scenario at small scale (the bench runs it 10 times, with plain Celery).

    AOF with ``appendfsync always``, late acks, a short visibility timeout;
    the broker is killed and restarted on the same data mid-run, then the
    worker is killed and another started.  Every task id must reach the
    ledger (which lives on a separate Redis).
    """
    ledger = redis_lib.Redis.from_url(redis_url)
    queues = ["ca", "cb"]
    with RedisServer(appendonly=True) as broker:
        fill_queues(broker.url, dict.fromkeys(queues, 200), task="ledger", args=(2,))
        ids = published_ids(redis_lib.Redis.from_url(broker.url), queues)
        visibility = 5
        env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_ACKS_LATE": "1",
               "CELERY_FAIR_VISIBILITY": str(visibility)}  # fmt: skip
        first = WorkerProcess(broker.url, queues, env=env).start()
        try:
            deadline = time.monotonic() + 60
            while len(ran_ids(ledger)) < 60:
                assert time.monotonic() < deadline, first.log()[-3000:]
                time.sleep(0.02)
            broker.restart(kill=True)  # SIGKILL mid-run, same port and AOF
            done = len(ran_ids(ledger))
            deadline = time.monotonic() + 60
            while KOMBU_REPOLLS_AFTER_RESTART and len(ran_ids(ledger)) < done + 60:
                assert time.monotonic() < deadline, (
                    f"no progress after the broker restart: {first.log()[-4000:]}"
                )
                time.sleep(0.02)
        finally:
            if first.proc is not None and first.proc.poll() is None:
                os.killpg(first.proc.pid, signal.SIGKILL)
            first.wait(timeout=30)
        # The second worker restores what the first held as it starts consuming,
        # once that is past the visibility timeout (started earlier, at its next
        # periodic scan: 100 s later on Kombu before 5.7).
        wait_unacked_restorable(broker.url, visibility)
        with WorkerProcess(broker.url, queues, env=env) as second:
            deadline = time.monotonic() + 120
            while not ids <= ran_ids(ledger):
                assert second.proc is not None and second.proc.poll() is None, second.log()
                assert time.monotonic() < deadline, (
                    f"{len(ids - ran_ids(ledger))} of {len(ids)} tasks lost"
                )
                time.sleep(0.1)
    assert ids <= ran_ids(ledger)


@pytest.mark.parametrize("live", [True, False])
def test_a_late_ack_on_a_closed_channel_goes_through_the_live_one(
    redis_url: str, live: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """After a reconnection, a late ack reaches the closed channel it came from.

    Kombu raises there (Celery 5.7's worker then stops).  The unacked keys
    are shared, so celery-fair acknowledges through the live channel; with
    none, the record stays for the visibility timeout (a duplicate, no loss).
    """
    caplog.set_level(logging.INFO, logger="celery_fair")
    client = redis_lib.Redis.from_url(redis_url)
    queue = Queue("lq", Exchange("lq"), routing_key="lq")
    with Connection(redis_url) as conn:
        channel = conn.channel()
        Producer(channel).publish({"n": 1}, exchange=queue.exchange, routing_key="lq",
                                  declare=[queue])  # fmt: skip
        got: list[Any] = []
        current: list[Any] = [None]
        install_on_channel(
            channel, FairScheduler({"lq": 1}), atomic=True, live_channel=lambda: current[0]
        )
        with Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)]):
            conn.drain_events(timeout=5)
        assert len(got) == 1 and client.hlen("unacked") == 1
        # As when the broker was down at close: nothing restored, the record stays.
        channel.qos.restore_at_shutdown = False
        channel.close()
        if live:
            current[0] = conn.channel()
        got[0].ack()  # must not raise
    if live:
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
        assert "through the new channel" in caplog.text
    else:
        assert client.hlen("unacked") == 1  # the visibility timeout will restore it
        assert "visibility timeout will redeliver" in caplog.text
    assert client.llen("lq") == 0


#: Published in this order (the message's number is its index).
PRIORITIES = [0, 6, 9, 0, 4, 3]


def kombu_order(steps: list[int]) -> list[int]:
    """Kombu's Redis order: the lowest step first (a priority falls in the step at or
    below it), FIFO within one step."""
    step = [max(s for s in steps if s <= p) for p in PRIORITIES]
    return sorted(range(len(PRIORITIES)), key=lambda n: (step[n], n))


def consume_with_priorities(
    redis_url: str, prefix: str, atomic: bool, options: dict[str, Any] | None = None
) -> list[int]:
    client = redis_lib.Redis.from_url(redis_url)
    client.flushdb()
    options = {**({"global_keyprefix": prefix} if prefix else {}), **(options or {})}
    queue = Queue("pq", Exchange("pq"), routing_key="pq", max_priority=9)
    order: list[int] = []
    with Connection(redis_url, transport_options=options) as conn:
        channel = conn.channel()
        producer = Producer(channel)
        for n, priority in enumerate(PRIORITIES):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="pq",
                             priority=priority, declare=[queue])  # fmt: skip
        cycle = install_on_channel(channel, FairScheduler({"pq": 1}), atomic=atomic)
        assert cycle is not None and (cycle.atomic is not None) == atomic

        def on_message(body: dict[str, Any], message: Any) -> None:
            assert client.hget(f"{prefix}unacked", message.delivery_tag) is not None
            order.append(body["n"])
            message.ack()

        with Consumer(channel, [queue], callbacks=[on_message]):
            deadline = time.monotonic() + 20
            while len(order) < len(PRIORITIES):
                assert time.monotonic() < deadline, order
                conn.drain_events(timeout=5)
    assert client.hlen(f"{prefix}unacked") == 0
    return order


@pytest.mark.parametrize("prefix", ["", "tenant-a:"])
def test_priorities_and_a_global_key_prefix_are_honoured(redis_url: str, prefix: str) -> None:
    """Kombu's priority sub-queues and ``global_keyprefix`` reach the script's keys.

    The atomic fetch serves priorities in the order Kombu's BRPOP does.
    """
    atomic = consume_with_priorities(redis_url, prefix, atomic=True)
    brpop = consume_with_priorities(redis_url, prefix, atomic=False)
    assert atomic == brpop
    # Kombu's Redis serves the lowest priority number first (0 is the most urgent,
    # the reverse of RabbitMQ), by its default steps 0, 3, 6, 9; FIFO within one.
    assert atomic == [0, 3, 4, 5, 1, 2] == kombu_order([0, 3, 6, 9])


@pytest.mark.parametrize(
    "options",
    [{"priority_steps": list(range(10))}, {"priority_steps": [0, 5]}, {"sep": "::"}],
    ids=["ten-steps", "two-steps", "sep"],
)
def test_priority_steps_and_the_separator_are_honoured(
    redis_url: str, options: dict[str, Any]
) -> None:
    """The transport's ``priority_steps`` and ``sep`` give the atomic fetch Kombu's order."""
    atomic = consume_with_priorities(redis_url, "", atomic=True, options=options)
    brpop = consume_with_priorities(redis_url, "", atomic=False, options=options)
    steps = options.get("priority_steps", [0, 3, 6, 9])
    assert atomic == brpop == kombu_order(steps)


def test_a_wake_up_during_a_fetch_is_not_lost(
    kombu_channel: tuple[Connection, Any], redis_url: str
) -> None:
    # The fetch script may read the queues just before the change that wakes
    # the worker: that wake-up must end the next wait, not its timeout.
    conn, channel = kombu_channel
    queue = Queue("tw", Exchange("tw"), routing_key="tw")
    consumer = Consumer(channel, [queue], callbacks=[lambda body, message: message.ack()])
    cycle = install_on_channel(channel, FairScheduler({}), atomic=True)
    assert cycle is not None and cycle.atomic is not None
    fetch = cycle.atomic
    client = redis_lib.Redis.from_url(redis_url)
    # Kombu's poller gives the channel's client its fetch connection; driven by hand here,
    # and the wake-ups are ours alone (no invalidation listener).
    pool = channel.client.connection_pool
    try:
        channel.client.connection = pool.get_connection()
    except TypeError:  # redis-py before 5.3 requires a command name (later ones deprecate it)
        channel.client.connection = pool.get_connection("_")
    fetch.close()
    fetch.listener = None
    client.delete(fetch._wake_key)  # the listener's first wake-up, at its start

    with consumer:
        fetch.start()  # a fetch: nothing there, the next is a wait
        with pytest.raises(Empty):
            fetch.read()
        fetch.tracking = True  # waits as long as with a listener: only a wake-up ends one
        fetch.start()  # the wait
        fetch.wake()  # an invalidation ends it
        with pytest.raises(Empty):
            fetch.read()
        fetch.start()  # the fetch after it: the script reads the empty queues
        fetch.wake()  # a publish right after that read
        with pytest.raises(Empty):
            fetch.read()  # nothing (the script read before the publish)
        assert client.llen(fetch._wake_key) == 1  # so the next wait ends at once


def test_a_malformed_payload_does_not_release_another_messages_credit(
    kombu_channel: tuple[Connection, Any], redis_url: str
) -> None:
    """A payload the fetch parks was fetched and released: held stays the messages held."""
    conn, channel = kombu_channel
    client = redis_lib.Redis.from_url(redis_url)
    queue = Queue("tm", Exchange("tm"), routing_key="tm")
    producer = Producer(channel)
    producer.publish({"n": 0}, exchange=queue.exchange, routing_key="tm", declare=[queue])
    client.lpush("tm", b"this is not json")  # fetched second (Kombu pops from the right)
    for n in (1, 2):
        producer.publish({"n": n}, exchange=queue.exchange, routing_key="tm")
    held: list[Any] = []
    scheduler = FairScheduler({"tm": 1})
    cycle = install_on_channel(channel, scheduler, atomic=True)
    assert cycle is not None and cycle.atomic is not None
    with Consumer(channel, [queue], callbacks=[lambda body, message: held.append(message)]):
        deadline = time.monotonic() + 20
        while len(held) < 3:
            assert time.monotonic() < deadline, held
            conn.drain_events(timeout=5)
    assert cycle.atomic.malformed == 1 and client.llen("tm.fair-malformed") == 1
    assert scheduler.held("tm") == 3  # the three messages not acknowledged yet
    for message in held:
        message.ack()
    assert scheduler.held("tm") == 0


def test_a_payload_that_decodes_only_in_its_tail_is_parked_not_left_unacked(
    kombu_channel: tuple[Connection, Any], redis_url: str
) -> None:
    """The script reads the tag from the payload's tail: the worker parks what does not
    decode whole and drops its unacknowledged record, so nothing comes back later."""
    conn, channel = kombu_channel
    client = redis_lib.Redis.from_url(redis_url)
    queue = Queue("tt", Exchange("tt"), routing_key="tt")
    producer = Producer(channel)
    producer.publish({"n": 0}, exchange=queue.exchange, routing_key="tt", declare=[queue])
    bad = 'not json, "properties": {"delivery_tag": "tail-only"}}'
    client.lpush("tt", bad)
    producer.publish({"n": 1}, exchange=queue.exchange, routing_key="tt")
    got: list[Any] = []
    cycle = install_on_channel(channel, FairScheduler({"tt": 1}), atomic=True)
    assert cycle is not None and cycle.atomic is not None
    with Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)]):
        deadline = time.monotonic() + 20
        while len(got) < 2 or cycle.atomic.malformed < 1:
            assert time.monotonic() < deadline, got
            conn.drain_events(timeout=5)
    assert [m.payload["n"] for m in got] == [0, 1]
    parked = client.lrange("tt.fair-malformed", 0, -1)
    assert len(parked) == 1 and json.loads(parked[0])["raw"] == bad
    assert client.hget("unacked", "tail-only") is None
    assert client.zscore("unacked_index", "tail-only") is None
    for message in got:
        message.ack()
    assert client.hlen("unacked") == 0
