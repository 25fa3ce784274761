"""The worker as deployments start it: Celery's defaults (mingle, gossip, heartbeat on).

Mingle's ``hello`` polls its reply queue on the task consumer's channel, and
its last ``BRPOP`` is still in flight when the fetch takes the channel over.
The fetch read that reply as the answer to its own first command, every
later reply landed one command late, and the worker stopped at its first
fetch ("'int' object is not subscriptable").  These tests start the worker
with Celery's defaults, and drive the channel into the same state directly.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

import pytest
import redis as redis_lib
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_fair.kombu.cycle import install_on_channel
from celery_fair.scheduling.scheduler import FairScheduler
from tests.harness.harness import WorkerProcess, fill_queues

pytestmark = [pytest.mark.integration, pytest.mark.compat]


def test_a_worker_started_with_celerys_defaults_runs_every_task(redis_url: str) -> None:
    # The reproduction: weights only, no keys, no limits; no flag added.
    client = redis_lib.Redis.from_url(redis_url)
    filled = {"da": 40, "db": 40}
    fill_queues(redis_url, filled, task="ledger", args=(0,))
    env = {"CELERY_FAIR_LEDGER": redis_url}
    args = ["--fair-weights", "da=1,db=3"]
    with WorkerProcess(redis_url, list(filled), env=env, extra_args=args) as w:
        deadline = time.monotonic() + 60
        while client.llen("ledger") < 80:
            assert w.proc is not None and w.proc.poll() is None, w.log()[-3000:]
            assert time.monotonic() < deadline, w.log()[-3000:]
            time.sleep(0.05)
        log = w.log()
    assert "mingle: searching for neighbors" in log  # mingle did run
    assert "CRITICAL" not in log and "Unrecoverable" not in log, log[-3000:]
    ids = [json.loads(e)["id"] for e in client.lrange("ledger", 0, -1)]
    assert len(ids) == len(set(ids)) == 80


@pytest.fixture
def connection(redis_url: str) -> Iterator[Connection]:
    with Connection(redis_url) as conn:
        yield conn


def _poll_once(conn: Connection) -> None:
    """Let Kombu send its BRPOP and return before the reply (its timeout is 1 s)."""
    with pytest.raises((TimeoutError, OSError, Empty)):
        conn.drain_events(timeout=0.05)


def _drain(conn: Connection, until: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline
        with contextlib.suppress(TimeoutError, OSError, Empty):
            conn.drain_events(timeout=0.5)


def test_a_message_kombus_brpop_popped_before_the_takeover_is_delivered(
    connection: Connection, redis_url: str
) -> None:
    channel = connection.channel()
    queue = Queue("ka", Exchange("ka"), routing_key="ka")
    got: list[int] = []

    def on_message(body: dict[str, int], message: Any) -> None:
        got.append(body["n"])
        message.ack()

    with Consumer(channel, [queue], callbacks=[on_message]):
        _poll_once(connection)  # Kombu's BRPOP is in flight
        Producer(channel).publish({"n": 0}, exchange=queue.exchange, routing_key="ka")
        # The server pops it into the pending reply; now the fetch takes over.
        cycle = install_on_channel(channel, FairScheduler({"ka": 1}), atomic=True)
        assert cycle is not None and cycle.atomic is not None
        for n in range(1, 4):
            Producer(channel).publish({"n": n}, exchange=queue.exchange, routing_key="ka")
        _drain(connection, lambda: len(got) >= 4)
    assert sorted(got) == [0, 1, 2, 3]
    assert cycle.atomic.fetches == 3  # the first came through Kombu's BRPOP reply
    client = redis_lib.Redis.from_url(redis_url)
    assert client.hlen("unacked") == 0 and client.llen("ka") == 0


def test_a_reply_popped_for_a_cancelled_consumer_goes_back_to_its_queue(
    connection: Connection, redis_url: str
) -> None:
    # Mingle: its reply queue's BRPOP is in flight when its consumer is
    # cancelled; a neighbour's reply arrives; the task consumer starts.
    channel = connection.channel()
    reply = Queue("reply.ka", Exchange("reply.ka"), routing_key="reply.ka")
    tasks = Queue("kb", Exchange("kb"), routing_key="kb")
    got: list[str] = []

    def on_message(body: dict[str, str], message: Any) -> None:
        got.append(body["q"])
        message.ack()

    mingle = Consumer(channel, [reply], callbacks=[on_message])
    mingle.consume()
    _poll_once(connection)
    mingle.cancel()
    Producer(channel).publish({"q": "reply"}, exchange=reply.exchange, routing_key="reply.ka")
    with Consumer(channel, [tasks], callbacks=[on_message]):
        install_on_channel(channel, FairScheduler({"kb": 1}), atomic=True)
        Producer(channel).publish({"q": "kb"}, exchange=tasks.exchange, routing_key="kb")
        _drain(connection, lambda: "kb" in got)
    client = redis_lib.Redis.from_url(redis_url)
    assert got == ["kb"]
    # Kombu requeued the reply nobody consumes any more: nothing popped is lost.
    assert client.llen("reply.ka") == 1
    assert json.loads(client.lindex("reply.ka", 0))["body"]
