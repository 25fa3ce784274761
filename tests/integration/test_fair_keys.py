"""Fairness keys on Redis: shares between the keys of one queue, with the real worker."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from tests.harness.control import wait_fair_stats
from tests.harness.harness import QUICK_STOP, WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key, restore_unacked
from tests.harness.ledger import Entry, Ledger

pytestmark = [pytest.mark.integration]

QUEUE = "keyed"


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    """A producer app with celery-fair and ``fair_keys`` (the user's surface)."""
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    yield app
    app.close()


def _worker(redis_url: str, **env: str) -> WorkerProcess:
    return WorkerProcess(
        redis_url,
        [QUEUE],
        concurrency=2,
        env={"CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id", "CELERY_FAIR_LEDGER": redis_url, **env},
    )


def _entries(ledger: Ledger, n: int, worker: WorkerProcess, timeout: float = 120) -> list[Entry]:
    assert ledger.wait_for(n, timeout=timeout, alive=[worker]), worker.log()[-3000:]
    return sorted(ledger.entries(), key=lambda e: e.started)


def test_publish_keeps_each_key_apart_and_in_order(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"a": 3, "b": 2}, ms=0)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    assert client.llen(QUEUE) == 0
    assert client.llen(names.key_list("a")) == 3 and client.llen(names.key_list("b")) == 2
    assert sorted(client.zrange(names.active, 0, -1)) == [b"a", b"b"]
    assert int(client.hget(names.state, "backlog") or 0) == 5
    # Each key's backlog, for the exporter's largest keys.
    assert client.zrange(names.sizes, 0, -1, withscores=True) == [(b"b", 2.0), (b"a", 3.0)]
    # Kombu's own size (queue_declare passive, celery purge) counts the keyed messages.
    with producer.connection_for_write() as conn:
        assert conn.default_channel.queue_declare(QUEUE, passive=True).message_count == 5
        assert conn.default_channel.queue_purge(QUEUE) == 5
    assert client.zcard(names.active) == 0 and client.llen(names.key_list("a")) == 0
    assert client.zcard(names.sizes) == 0


def test_purge_deletes_the_messages_of_keys_throttled_by_their_limits(
    redis_url: str, producer: Celery
) -> None:
    from celery_fair.keys import store

    publish_by_key(producer, QUEUE, {"a": 3, "b": 2, "c": 4}, ms=0)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    # What the fetch script does to keys at their limits: out of line, set aside.
    client.zrem(names.active, "b", "c")
    client.sadd(names.at_limit, "b")
    client.zadd(names.sleep, {"c": 1e12})
    client.hset(names.throttled_since, mapping={"b": 1.0, "c": 1.0})
    client.hset(names.throttled_owed, mapping={"a": 2.0})  # a hold its next task would report
    assert store.purge(client, names) == 9
    assert all(client.llen(names.key_list(k)) == 0 for k in "abc")
    assert int(client.hget(names.state, "backlog") or 0) == 0
    assert client.scard(names.at_limit) == client.zcard(names.sleep) == 0
    assert client.hlen(names.throttled_since) == client.hlen(names.throttled_owed) == 0


def test_keys_share_one_queue_by_weight(redis_url: str, producer: Celery) -> None:
    weights = {"a": 1, "b": 2, "c": 4}
    # Each key's backlog lasts as long as the others' at these weights.
    publish_by_key(producer, QUEUE, {k: 150 * w for k, w in weights.items()}, ms=2)
    ledger = Ledger(redis_url)
    with _worker(redis_url, CELERY_FAIR_KEY_WEIGHTS="a=1,b=2,c=4") as worker:
        entries = _entries(ledger, 800, worker)
        fetch = wait_fair_stats(redis_url)["atomic_fetch"]
        worker.stop(QUICK_STOP)  # measured
    window = entries[50:750]  # every key backlogged throughout
    counts = Counter(e.tenant for e in window)
    for key, weight in weights.items():
        assert counts[key] / len(window) == pytest.approx(weight / 7, abs=0.02), counts
    # A fetch takes what the prefetch window has room for in one call, in the
    # fair order: the shares above hold with batches.
    assert fetch["calls"] < fetch["fetches"], fetch


@pytest.mark.compat
def test_keys_passed_by_position_share_by_weight(
    redis_url: str, producer: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # def ledger(self, ms=0.0, tenant_id=None), called as users often call it:
    # ledger.delay(2, "acme"). The producer's app knows the task's signature.
    @producer.task(name="ledger", bind=True, shared=False)
    def ledger(self: object, ms: float = 0.0, tenant_id: str | None = None) -> None: ...

    weights = {"a": 1, "b": 2, "c": 4}
    left = {k: 150 * w for k, w in weights.items()}
    with producer.producer_or_acquire() as conn:
        while any(left.values()):
            for key in weights:
                if left[key]:
                    left[key] -= 1
                    ledger.apply_async((2, key), queue=QUEUE, producer=conn)
        # A task this app does not know, by position: its key cannot be found.
        with caplog.at_level("WARNING", logger="celery_fair.keys.publish"):
            for _ in range(3):
                producer.send_task("elsewhere", (1, "a"), queue=QUEUE, producer=conn)
    warnings = [r.getMessage() for r in caplog.records if "without a key" in r.getMessage()]
    assert len(warnings) == 1 and "'elsewhere'" in warnings[0] and "'tenant_id'" in warnings[0]
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(KeyedNames(QUEUE).key_list("c")) == 600
    assert client.llen(QUEUE) == 3  # the unkeyed key: served too, never stranded
    ledger_log = Ledger(redis_url)
    with _worker(redis_url, CELERY_FAIR_KEY_WEIGHTS="a=1,b=2,c=4") as worker:
        entries = _entries(ledger_log, 800, worker)
        worker.stop(QUICK_STOP)  # measured
    counts = Counter(e.tenant for e in entries[50:750])  # every key backlogged throughout
    for key, weight in weights.items():
        assert counts[key] / 700 == pytest.approx(weight / 7, abs=0.02), counts


@pytest.mark.compat
def test_a_global_key_prefix_is_honoured(redis_url: str) -> None:
    # Kombu's client prefixes some commands only (EVALSHA: its first key): every
    # name celery-fair writes must carry the prefix once, on producer and worker.
    prefix = "tenant-a:"
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    try:
        publish_by_key(app, QUEUE, {"a": 150, "b": 300}, ms=2)
    finally:
        app.close()
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(prefix + KeyedNames(QUEUE).key_list("a")) == 150
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_KEY_WEIGHTS": "a=1,b=2", "CELERY_FAIR_KEYPREFIX": prefix}
    with _worker(redis_url, **env) as worker:
        entries = _entries(ledger, 400, worker)
        worker.stop(QUICK_STOP)  # measured
    counts = Counter(e.tenant for e in entries[20:380])  # both keys backlogged
    assert counts["b"] / 360 == pytest.approx(2 / 3, abs=0.03), counts
    ours = [k.decode() for k in client.scan_iter() if b"fair" in k]
    assert ours and all(k.startswith(prefix) and not k.startswith(prefix * 2) for k in ours), ours


def test_runtime_cost_splits_worker_time_between_keys(
    redis_url: str, producer: Celery, tmp_path: Path
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    publish_by_key(producer, QUEUE, {"slow": 250}, ms=10)
    publish_by_key(producer, QUEUE, {"fast": 2500}, ms=1)
    ledger = Ledger(redis_url)
    telemetry = tmp_path / "telemetry"
    with _worker(
        redis_url, CELERY_FAIR_COST="runtime", CELERY_FAIR_TELEMETRY_DIR=str(telemetry)
    ) as worker:
        _entries(ledger, 1400, worker)
    # Worker time as the worker measured it (telemetry: the pool's run time),
    # while both keys were backlogged.
    rows = sorted(
        (r for r in pq.read_table(telemetry).to_pylist() if r["outcome"] == "success"),
        key=lambda r: r["started"],
    )
    last = min(max(r["started"] for r in rows if r["fair_key"] == k) for k in ("slow", "fast"))
    window = [r for r in rows[100:] if r["started"] < last]
    busy = Counter[str]()
    for r in window:
        busy[r["fair_key"]] += r["runtime"]
    share = busy["slow"] / (busy["slow"] + busy["fast"])
    assert share == pytest.approx(0.5, abs=0.05), (busy, len(window))
    # Not a count share (that would be about 1): the short key completes as many
    # times more tasks as its tasks are shorter (5-10x on a quiet machine; the
    # per-task overhead grows on a loaded one and brings the ratio down).
    counts = Counter(r["fair_key"] for r in window)
    mean = {k: busy[k] / counts[k] for k in counts}
    ratio = counts["fast"] / counts["slow"]
    assert ratio > 2.5 and ratio == pytest.approx(mean["slow"] / mean["fast"], rel=0.15), counts


def test_a_message_from_a_plain_producer_still_runs(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"a": 20}, ms=0)
    # A producer without celery-fair: its message goes to the queue's own list.
    code = (
        "import sys; from celery import Celery; app = Celery(broker=sys.argv[1]); "
        f"app.send_task('ledger', kwargs={{'tenant_id': 'plain'}}, queue={QUEUE!r})"
    )
    subprocess.run([sys.executable, "-c", code, redis_url], check=True, timeout=60)
    assert redis_lib.Redis.from_url(redis_url).llen(QUEUE) == 1
    ledger = Ledger(redis_url)
    with _worker(redis_url) as worker:
        entries = _entries(ledger, 21, worker)
    assert Counter(e.tenant for e in entries) == {"a": 20, "plain": 1}


def test_weights_change_live_for_the_backlog(redis_url: str, producer: Celery) -> None:
    publish_by_key(producer, QUEUE, {"a": 1000, "b": 1000}, ms=4)
    ledger = Ledger(redis_url)
    with _worker(redis_url) as worker:
        _entries(ledger, 100, worker)
        app = Celery(broker=redis_url)
        celery_fair.install(app)
        deadline = time.monotonic() + 30
        while True:
            replies = app.control.broadcast(
                "fair_key_weights", arguments={"weights": ["b=3"]}, reply=True, timeout=2, limit=1
            )
            if replies:
                break
            assert time.monotonic() < deadline, "no reply to fair_key_weights"
        assert "error" not in str(replies), replies
        changed_at = time.time()
        entries = _entries(ledger, 1500, worker)
    after = [e for e in entries if e.started > changed_at + 0.2][:400]
    assert len(after) == 400, (len(after), len(entries))
    counts = Counter(e.tenant for e in after)
    assert counts["b"] / len(after) == pytest.approx(0.75, abs=0.03), counts


def test_a_crash_loses_nothing_and_restores_to_each_key(redis_url: str, producer: Celery) -> None:
    keys = {f"t{i}": 40 for i in range(4)}
    publish_by_key(producer, QUEUE, keys, ms=20)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_ACKS_LATE": "1", "CELERY_FAIR_VISIBILITY": "2"}
    worker = _worker(redis_url, **env).start()
    try:
        assert ledger.wait_for(20, timeout=60, alive=[worker]), worker.log()[-3000:]
        worker.kill()
    finally:
        worker.stop()
    before = int(client.hget(names.state, "backlog") or 0)
    unacked = restore_unacked(producer, client, visibility=2)
    assert unacked > 0  # the killed worker held messages
    # Back in their keys' lists, not in the queue's own list.
    assert client.llen(QUEUE) == 0
    assert int(client.hget(names.state, "backlog") or 0) == before + unacked
    with _worker(redis_url, **env) as worker:
        deadline = time.monotonic() + 120
        while len({e.id for e in ledger.entries()}) < sum(keys.values()):
            assert time.monotonic() < deadline, worker.log()[-3000:]
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            time.sleep(0.2)
    ran = Counter(e.tenant for e in {e.id: e for e in ledger.entries()}.values())
    assert ran == keys  # every task ran; none lost


def test_an_idle_keyed_queue_is_woken_by_a_publish(redis_url: str, producer: Celery) -> None:
    # An idle fetch waits for an invalidation of the keys it watches; a keyed
    # publish touches only the key's list and the active-key set.
    ledger = Ledger(redis_url)
    with _worker(redis_url) as worker:
        for i in range(5):
            publish_by_key(producer, QUEUE, {f"k{i}": 1}, ms=0)
            assert ledger.wait_for(i + 1, timeout=30, alive=[worker]), worker.log()[-3000:]
        stats = wait_fair_stats(redis_url)
    fetch = stats["atomic_fetch"]
    assert fetch["tracking"] is True
    assert fetch["wakeups"] >= 5, fetch
    keys = stats["keys"]
    assert keys["served"] == {QUEUE: 5}
    assert keys["backlog"][QUEUE]["messages"] == 0


def test_a_worker_without_celery_fair_on_a_keyed_queue_is_reported(redis_url: str) -> None:
    with WorkerProcess(redis_url, [QUEUE], fair=False, name="plain-keyed") as plain:
        deadline = time.monotonic() + 60
        while " ready." not in plain.log():
            assert time.monotonic() < deadline, plain.log()[-3000:]
            time.sleep(0.1)
        with _worker(redis_url) as fair:
            deadline = time.monotonic() + 60
            while "without celery-fair" not in fair.log():
                assert fair.proc is not None and fair.proc.poll() is None, fair.log()[-3000:]
                assert time.monotonic() < deadline, fair.log()[-3000:]
                time.sleep(0.1)
    line = next(x for x in fair.log().splitlines() if "without celery-fair" in x)
    assert "plain-keyed@" in line and "keyed queue(s) keyed" in line
    assert fair.name not in line  # a celery-fair worker is not reported


def test_an_app_without_fair_keys_in_the_same_process_publishes_plainly(
    redis_url: str, producer: Celery
) -> None:
    plain = Celery("plain-in-process", broker=redis_url)
    celery_fair.install(plain)  # celery-fair, but no fair_keys
    publish_by_key(producer, QUEUE, {"a": 2}, ms=0)
    publish_by_key(plain, QUEUE, {"b": 3}, ms=0)
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(QUEUE) == 3  # the plain app's, in Kombu's own list
    assert client.llen(KeyedNames(QUEUE).key_list("a")) == 2
    assert client.llen(KeyedNames(QUEUE).key_list("b")) == 0
    plain.close()


def test_a_key_from_a_header_given_to_apply_async(redis_url: str) -> None:
    app = Celery("header-keyed", broker=redis_url)
    app.conf.fair_keys = {QUEUE: "header:x-tenant"}
    celery_fair.install(app)
    app.send_task("ledger", queue=QUEUE, headers={"x-tenant": "t1"})
    app.send_task("ledger", queue=QUEUE)  # no key: the queue's own list
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(KeyedNames(QUEUE).key_list("t1")) == 1
    assert client.llen(QUEUE) == 1
    app.close()
