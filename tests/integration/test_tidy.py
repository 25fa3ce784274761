"""The keyed queues' tidy (``tidy.lua``) against a real Redis: an earlier release's
throttling records moved to their names, keys below their limit put back in line,
and a real worker that finds a queue as an earlier release left it runs everything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery

from celery_fair.keys import store
from celery_fair.keys.layout import (
    OLD_AT_LIMIT,
    OLD_THROTTLED,
    OLD_THROTTLED_COUNT,
    OLD_THROTTLED_OWED,
    OLD_THROTTLED_SECONDS,
    OLD_THROTTLED_SINCE,
    THROTTLED_COUNT,
    THROTTLED_SECONDS,
    KeyedNames,
)
from celery_fair.wire.replies import Idle, KeyedMessage, decode_fetch
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.scripts import NAMES, SEP, Q, message
from tests.harness.scripts import enqueue as enqueue_raw
from tests.harness.scripts import fetch as fetch_raw

pytestmark = [pytest.mark.integration]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis_lib.Redis]:
    yield redis_lib.Redis.from_url(redis_url)


def old(suffix: str) -> str:
    """An earlier release's name of one of the queue's records."""
    return f"{Q}{SEP}{suffix}"


def fetch(client: Any, word: str = "L1:30") -> Any:
    """One fetch of the keyed queue with per-key limits (leases of 30 s), decoded."""
    return decode_fetch(fetch_raw(client, word))


def enqueue(client: Any, key: str) -> None:
    enqueue_raw(client, key, message(key))


def test_an_earlier_releases_records_are_merged_into_the_current_names(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.limits_conf, "c:*", "1")
    for key in ("a", "b", "c"):
        enqueue(client, key)
    # As a worker of the earlier release leaves them: "a" at its limit (one
    # task running), "b" set aside and since freed by that release's release,
    # which looked in the old set only; "c" set aside by this release and freed
    # by the earlier one (the current set, running 0).
    client.zrem(NAMES.active, "a", "b", "c")
    client.hset(NAMES.running, "a", 1)
    client.sadd(old(OLD_AT_LIMIT), "a", "b")
    client.sadd(NAMES.at_limit, "c")
    client.hset(old(OLD_THROTTLED_SINCE), mapping={"a": 100.0, "x": 50.0})
    client.hset(NAMES.throttled_since, mapping={"x": 70.0})
    client.zadd(old(OLD_THROTTLED), {"a": 2.0, "y": 1.0})
    client.zadd(NAMES.throttled, {"a": 1.0})
    client.hset(old(OLD_THROTTLED_OWED), mapping={"a": 1.5})
    client.hset(NAMES.throttled_owed, mapping={"a": 0.5})
    client.hset(NAMES.state, mapping={OLD_THROTTLED_COUNT: 3, OLD_THROTTLED_SECONDS: 4.5})
    client.hset(NAMES.state, THROTTLED_COUNT, 1)

    done = store.tidy(client, SEP, [Q])

    # Records moved: 2 keys set aside, 2 since-stamps, 2 sums, 1 owed, 2 state fields.
    assert done == store.Tidied(moved=9, readmitted=2)
    for suffix in (OLD_AT_LIMIT, OLD_THROTTLED_SINCE, OLD_THROTTLED, OLD_THROTTLED_OWED):
        assert not client.exists(old(suffix)), suffix
    assert not client.hexists(NAMES.state, OLD_THROTTLED_COUNT)
    assert not client.hexists(NAMES.state, OLD_THROTTLED_SECONDS)
    assert client.smembers(NAMES.at_limit) == {b"a"}  # still at its limit
    assert float(client.hget(NAMES.throttled_since, "x") or 0) == 50.0  # the earlier time
    assert client.zscore(NAMES.throttled, "a") == 3.0 and client.zscore(NAMES.throttled, "y") == 1
    assert float(client.hget(NAMES.throttled_owed, "a") or 0) == 2.0
    assert client.hget(NAMES.state, THROTTLED_COUNT) == b"4"
    assert float(client.hget(NAMES.state, THROTTLED_SECONDS) or 0) == 4.5
    # b and c, below their limit, are back in line and served; a waits.
    served = [fetch(client), fetch(client)]
    assert sorted(r.fair_key for r in served if isinstance(r, KeyedMessage)) == ["b", "c"]
    assert isinstance(fetch(client), Idle)
    # Nothing more to do: a second tidy changes nothing.
    assert store.tidy(client, SEP, [Q]) == store.Tidied(0, 0)


def test_a_slot_freed_the_earlier_releases_way_is_repaired(client: redis_lib.Redis) -> None:
    client.hset(NAMES.limits_conf, "c:a", "1")
    enqueue(client, "a")
    enqueue(client, "a")
    first = fetch(client)
    assert isinstance(first, KeyedMessage) and first.fair_key == "a"
    assert isinstance(fetch(client), Idle)  # a is at its limit: set aside
    assert client.smembers(NAMES.at_limit) == {b"a"}
    # A worker of the earlier release frees the slot: its release script
    # decrements the running count and looks for the key in the old set only.
    tag = next(iter(client.hkeys(NAMES.lease_keys)))
    client.hdel(NAMES.lease_keys, tag)
    client.zrem(NAMES.leases, tag)
    client.hincrby(NAMES.running, "a", -1)
    client.srem(old(OLD_AT_LIMIT), "a")
    assert isinstance(fetch(client), Idle)  # stuck without the tidy
    assert store.tidy(client, SEP, [Q]) == store.Tidied(moved=0, readmitted=1)
    again = fetch(client)
    assert isinstance(again, KeyedMessage) and again.fair_key == "a"


def test_a_raised_limit_lets_a_key_set_aside_go_at_the_next_tidy(client: redis_lib.Redis) -> None:
    client.hset(NAMES.limits_conf, "c:a", "1")
    for _ in range(3):
        enqueue(client, "a")
    assert isinstance(fetch(client), KeyedMessage)
    assert isinstance(fetch(client), Idle)
    store.set_live_limits(client, NAMES, {"c:a": "2"})
    assert store.tidy(client, SEP, [Q]).readmitted == 1
    assert isinstance(fetch(client), KeyedMessage)
    assert isinstance(fetch(client), Idle)  # two running: at the raised limit
    assert store.tidy(client, SEP, [Q]).readmitted == 0


QUEUE = "upgraded"


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    yield app
    app.close()


def test_a_worker_runs_every_task_of_a_queue_an_earlier_release_left(
    redis_url: str, producer: Celery
) -> None:
    """Keys the earlier release set aside (under its names) with their slots
    since freed: without the tidy nothing would bring them back in line."""
    publish_by_key(producer, QUEUE, {"t1": 20, "t2": 20, "t3": 20}, ms=5)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    # What the earlier release leaves: t1 and t2 set aside in its set, out of line.
    client.zrem(names.active, "t1", "t2")
    client.sadd(f"{QUEUE}{SEP}{OLD_AT_LIMIT}", "t1", "t2")
    client.hset(f"{QUEUE}{SEP}{OLD_THROTTLED_SINCE}", mapping={"t1": 1.0, "t2": 1.0})
    client.hset(names.state, OLD_THROTTLED_COUNT, 2)
    ledger = Ledger(redis_url)
    env = {
        "CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id",
        "CELERY_FAIR_LEDGER": redis_url,
        "CELERY_FAIR_KEY_CONCURRENCY": "*=2",
    }
    with WorkerProcess(redis_url, [QUEUE], concurrency=4, env=env) as worker:
        assert ledger.wait_for(60, timeout=90, alive=[worker]), worker.log()[-3000:]
        assert "moved" in worker.log() and "earlier release" in worker.log()
    assert sorted({e.tenant for e in ledger.entries()}) == ["t1", "t2", "t3"]
    assert not client.exists(f"{QUEUE}{SEP}{OLD_AT_LIMIT}")
    assert client.scard(names.at_limit) == 0
    assert int(client.hget(names.state, THROTTLED_COUNT) or 0) >= 2
