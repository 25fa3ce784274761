"""A flood that fills Redis to its maxmemory: the worker stays up and drains it.

A real Redis (or Valkey) with ``maxmemory`` and ``noeviction`` (the policy
Celery's docs expect of a broker), one worker as deployments start it, and a
producer that floods one queue with 4 KB tasks until the broker refuses.
Once full, Redis refuses every command queued in ``MULTI``, Kombu's
acknowledgement among them: a plain Celery worker exits ("Unrecoverable
error: OutOfMemoryError") with the backlog on the broker (see
``python -m bench.broker_full``).  With celery-fair the worker acknowledges
outside a transaction, runs every accepted task once, and publishing works
again without a hand.  The ledger lives on another Redis: the full one
refuses its writes too.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis as redis_lib

from tests.conftest import MAXMEMORY
from tests.harness.clock import FakeClock
from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer
from tests.integration.production_app import make_app
from tests.integration.test_production import APP, assert_clean, running, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.compat]

PAD = "x" * 4000
#: The flood goes on this long after the broker first refuses it (a tenant
#: that keeps trying: the broker stays full while the worker drains), and
#: stops by itself at FLOOD_MAX messages or FLOOD_SECONDS in all.
FULL_FOR, FLOOD_MAX, FLOOD_SECONDS = 8.0, 40_000, 90.0
#: What the worker logs the first time the broker refuses one of its writes.
FULL_SAID = "celery-fair: the broker is full"


def flood_env(broker: str, ledger: str, kind: str, **more: str) -> dict[str, str]:
    """The production app's environment for a flood of the queue ``flood`` (``quiet``
    beside it): ``kind`` "keyed" keys it by tenant, "plain" is Celery without celery-fair."""
    env = {
        "CELERY_FAIR_BROKER": broker,
        "CELERY_FAIR": "0" if kind == "plain" else "1",
        "PRODUCTION_LEDGER": ledger,
        "PRODUCTION_WEIGHTS": "flood=1,quiet=1",
        # Celery's default early acks: each task is acknowledged as it starts,
        # while the broker is still full (late acks come after the flood).
        "PRODUCTION_ACKS_LATE": "0",
        **more,
    }
    if kind == "keyed":
        env["PRODUCTION_KEYS"] = "flood=tenant_id"
    return env


def _set_full(client: redis_lib.Redis, full: bool) -> None:
    """Put the broker's ``maxmemory`` below what it uses (every write refused), or back."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used // 2) if full else MAXMEMORY)


def _refuses_multi_when_full(client: redis_lib.Redis) -> bool:
    """Whether this server, when full, refuses a transaction that only frees memory
    (Redis 7 does; Valkey 8 runs it)."""
    _set_full(client, True)
    try:
        client.pipeline(transaction=True).zrem("none", "x").hdel("none", "x").execute()
    except redis_lib.exceptions.ResponseError:
        return True
    finally:
        _set_full(client, False)
    return False


def _flood(producer: object, kind: str) -> tuple[list[int], int]:
    """Publish to ``flood`` until FULL_FOR seconds after the first refusal: the values
    accepted, and how many publishes were refused."""
    record = producer.tasks["prod.record"]  # type: ignore[attr-defined]
    accepted: list[int] = []
    refused = 0
    start = time.monotonic()
    stop = start + FLOOD_SECONDS
    while len(accepted) < FLOOD_MAX and time.monotonic() < stop:
        value = len(accepted) + refused
        options: dict[str, object] = {"queue": "flood", "headers": {"pad": PAD}}
        if kind == "priority":
            options["priority"] = value % 10
        kwargs = {"ms": 2, "tenant_id": f"t{value % 5}"} if kind == "keyed" else {"ms": 2}
        try:
            record.apply_async((value,), kwargs, retry=False, **options)
        except Exception:  # the broker refused: full
            if not refused:
                stop = min(stop, time.monotonic() + FULL_FOR)
            refused += 1
            continue
        accepted.append(value)
    return accepted, refused


@pytest.mark.parametrize("kind", ["weighted", "keyed", "priority"])
def test_a_worker_drains_a_full_broker_and_publishing_recovers(
    full_broker: RedisServer, redis_url: str, kind: str
) -> None:
    env = flood_env(full_broker.url, redis_url, kind)
    producer = make_app(env, name="full-producer")
    worker = WorkerProcess(
        full_broker.url, ["flood", "quiet"], concurrency=2, app=APP, env=env, extra_args=["-E"]
    )
    ledger = redis_lib.Redis.from_url(redis_url)
    refuses_acks = _refuses_multi_when_full(full_broker.client())
    with running(worker):
        wait_until(lambda: " ready." in worker.log(), "the worker", [worker])
        accepted, refused = _flood(producer, kind)
        used = full_broker.client().info("memory")
        assert refused, f"the broker never filled: {used['used_memory_human']}"
        if refuses_acks and FULL_SAID not in worker.log():
            # The flood keeps the broker at its limit, not always over it: each ack
            # frees room the producer fills at once, and an ack can find room every
            # time, rarely. Held over its limit, the
            # worker still starts the tasks it holds and acknowledges them.
            _set_full(full_broker.client(), True)
            try:
                wait_until(lambda: FULL_SAID in worker.log(), "an ack while full", [worker])
            finally:
                _set_full(full_broker.client(), False)
        wait_until(
            lambda: ledger.llen("ledger") >= len(accepted),
            lambda: f"{len(accepted)} runs (ran {ledger.llen('ledger')})",
            [worker], timeout=240,
        )  # fmt: skip
        # Publishing works again without a hand: the backlog drained.
        producer.tasks["prod.record"].apply_async((-1,), {"ms": 0}, queue="quiet", retry=False)
        wait_until(lambda: ledger.llen("ledger") > len(accepted), "a task after", [worker])
        log = worker.log()
    runs = Counter(json.loads(raw)["value"] for raw in ledger.lrange("ledger", 0, -1))
    assert set(runs) == {*accepted, -1} and max(runs.values()) == 1  # every accepted task, once
    # Where the server refuses Kombu's acknowledgement when full, celery-fair said so.
    assert (FULL_SAID in log) == refuses_acks, log[-3000:]
    assert_clean(log, worker.name)
    producer.close()


def test_settling_while_full_acks_now_and_requeues_when_the_broker_accepts(
    full_broker: RedisServer,
) -> None:
    from kombu import Connection

    from celery_fair import compat
    from celery_fair.kombu.full import RETRY_FIRST, FullBroker

    clock = FakeClock()
    full = FullBroker(clock=clock)
    client = full_broker.client()
    with Connection(full_broker.url) as conn:
        channel = conn.channel()
        queue = conn.SimpleQueue("settle")
        queue.put({"n": 1})
        queue.put({"n": 2})
        first, second = queue.get(timeout=5), queue.get(timeout=5)
        qos = first.channel.qos
        assert client.hlen("unacked") == 2
        _set_full(client, True)
        with pytest.raises(redis_lib.exceptions.ResponseError) as refused:
            queue.put({"n": 3})
        assert compat.broker_full(refused.value)
        # The fallback removes the record outside a transaction, still full.
        full.acknowledge(qos, first.delivery_tag, refused.value)
        assert client.hlen("unacked") == 1 and client.zcard("unacked_index") == 1
        # A requeue cannot be done while full: the message waits where it is.
        full.requeue_later(qos, second.delivery_tag, refused.value)
        clock.now = RETRY_FIRST
        full.retry()
        assert client.hlen("unacked") == 1 and client.llen("settle") == 0
        assert full.statistics().requeues_waiting == 1
        _set_full(client, False)  # the backlog drained
        clock.now = 10 * RETRY_FIRST
        full.retry()
        assert client.hlen("unacked") == 0 and client.llen("settle") == 1
        stats = full.statistics()
        assert (stats.acks, stats.requeues_refused, stats.requeued_later) == (1, 1, 1)
        assert queue.get(timeout=5).payload == {"n": 2}  # nothing lost
        queue.close()
        channel.close()


def test_restoring_past_the_visibility_timeout_waits_while_full(
    full_broker: RedisServer,
) -> None:
    """Kombu's restore round takes a lock with ``SET NX``, which a full Redis refuses: at a
    worker's start that error stopped it.  The round is skipped and counted."""
    from kombu import Connection

    from celery_fair import compat
    from celery_fair.kombu.full import FullBroker

    full = FullBroker()
    compat.skip_restores_while_full(full.restore_skipped)  # once per process, as a worker does
    client = full_broker.client()
    with Connection(full_broker.url) as conn:
        channel = conn.channel()
        _set_full(client, True)
        channel.qos.restore_visible(interval=1)
        assert full.statistics().restores_skipped == 1
        _set_full(client, False)
        channel.qos.restore_visible(interval=1)  # accepted again: a round of Kombu's own
        assert full.statistics().restores_skipped == 1
        channel.close()


#: Tasks waiting when a worker starts against a broker already full.
WAITING = 400


@pytest.mark.parametrize("kind", ["plain", "weighted", "keyed"])
def test_a_worker_started_against_a_full_broker_starts_and_drains_it(
    full_broker: RedisServer, redis_url: str, kind: str
) -> None:
    """At start a worker declares its queues and, for remote control, mingle and gossip,
    queues of its own: Kombu reads a queue's length in ``MULTI``, binds with ``SADD`` and
    deletes a reply queue in ``MULTI``, all refused by a full Redis.  Plain Celery exits
    (the premise, checked here); a celery-fair worker starts and drains the backlog."""
    env = flood_env(full_broker.url, redis_url, kind)
    producer = make_app(env, name="start-full-producer")
    record = producer.tasks["prod.record"]
    for i in range(WAITING):
        kwargs = {"ms": 1, "tenant_id": f"t{i % 5}"} if kind == "keyed" else {"ms": 1}
        record.apply_async((i,), kwargs, queue="flood", headers={"pad": PAD})
    client = full_broker.client()
    _set_full(client, True)
    worker = WorkerProcess(
        full_broker.url, ["flood", "quiet"], concurrency=2, app=APP, env=env,
        fair=kind != "plain", extra_args=["-E"],
    )  # fmt: skip
    ledger = redis_lib.Redis.from_url(redis_url)
    with running(worker):
        if kind == "plain":
            assert worker.proc is not None
            worker.proc.wait(timeout=60)  # it exits: subprocess.TimeoutExpired if not
            assert "OutOfMemoryError" in worker.log()
            producer.close()
            return
        wait_until(
            lambda: ledger.llen("ledger") >= WAITING,
            lambda: f"{WAITING} runs (ran {ledger.llen('ledger')})", [worker],
        )  # fmt: skip
        log = worker.log()
    runs = Counter(json.loads(raw)["value"] for raw in ledger.lrange("ledger", 0, -1))
    assert set(runs) == set(range(WAITING)) and max(runs.values()) == 1
    assert "celery-fair: the broker is full" in log
    assert_clean(log, worker.name)
    producer.close()
