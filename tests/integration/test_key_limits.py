"""Per-key concurrency and rate limits, enforced at the fetch, with real workers on Redis."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery

from celery_fair.keys.layout import KeyedNames
from tests.harness.control import wait_fair_stats
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.keys import keyed_app, most_at_once, publish_by_key
from tests.harness.ledger import Ledger

pytestmark = [pytest.mark.integration]

QUEUE = "limited"


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    yield app
    app.close()


def _worker(url: str, concurrency: int = 4, pool: str = "prefork", **env: str) -> WorkerProcess:
    return WorkerProcess(
        url, [QUEUE], pool=pool, concurrency=concurrency,
        env={"CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id", "CELERY_FAIR_LEDGER": url, **env},
    )  # fmt: skip


def test_concurrency_limits_hold_across_two_workers(redis_url: str, producer: Celery) -> None:
    singles = {f"k{i}": 30 for i in range(6)}
    publish_by_key(producer, QUEUE, {**singles, "wide": 90}, ms=60)
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_KEY_CONCURRENCY": "*=1,wide=3"}
    with _worker(redis_url, **env) as w1, _worker(redis_url, **env) as w2:
        assert ledger.wait_for(270, timeout=120, alive=[w1, w2]), w1.log()[-3000:]
        stats = wait_fair_stats(redis_url)
    entries = ledger.entries()
    most = most_at_once(entries)
    assert all(most[k] <= 1 for k in singles), most
    assert most["wide"] == 3, most  # reaches its limit, never more
    # The 8 slots stay busy with the other keys while every key has work
    # (9 slots' worth of keys: 6 x 1 + 3): average tasks running at once.
    start = min(e.started for e in entries)
    end = min(max(e.started for e in entries if e.tenant == k) for k in [*singles, "wide"])
    busy = sum(min(e.finished, end) - max(e.started, start) for e in entries if e.started < end)
    assert busy / (end - start) > 0.75 * 8, (busy / (end - start), end - start)
    limits = stats["keys"]["limits_state"][QUEUE]
    assert limits["limits"] == {"c:*": "1", "c:wide": "3"}
    assert limits["running"] == {}  # every slot came back
    # Throttling, as the broker timed it: keys were held back, and none is now.
    assert limits["throttled_count"] > 0 and limits["throttled_seconds"] > 0, limits
    assert limits["throttled_tasks"] == 0 and limits["at_limit"] == 0, limits
    throttled_keys = {key for key, _ in limits["top_throttled"]}
    assert throttled_keys and throttled_keys <= {*singles, "wide"}, limits["top_throttled"]


def test_a_rate_limited_key_runs_at_its_rate(
    redis_url: str, producer: Celery, tmp_path: Path
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    publish_by_key(producer, QUEUE, {"slow": 40}, ms=1)
    publish_by_key(producer, QUEUE, {f"free{i}": 60 for i in range(4)}, ms=1)
    ledger = Ledger(redis_url)
    telemetry = tmp_path / "telemetry"
    env = {
        "CELERY_FAIR_KEY_RATE": "slow=10/s",
        "CELERY_FAIR_KEY_WEIGHTS": "free0=3",
        "CELERY_FAIR_TELEMETRY_DIR": str(telemetry),
    }
    with _worker(redis_url, 2, **env) as w1, _worker(redis_url, 2, **env) as w2:
        assert ledger.wait_for(280, timeout=120, alive=[w1, w2]), w1.log()[-3000:]
        stats = wait_fair_stats(redis_url)
    # Out of tokens, the key was set aside again and again, and timed.
    limits = stats["keys"]["limits_state"][QUEUE]
    assert limits["throttled_count"] >= 20 and limits["throttled_seconds"] > 1.0, limits
    assert [key for key, _ in limits["top_throttled"]] == ["slow"], limits["top_throttled"]
    entries = sorted(ledger.entries(), key=lambda e: e.started)
    slow = [e.started for e in entries if e.tenant == "slow"]
    # After the bucket's first second's worth (10 tokens), 10 per second: the
    # slope of the starts over time, which a start delayed at either end (a
    # worker busy for a moment) does not bend as it bends first-to-last.
    steady = slow[10:]
    fit = statistics.linear_regression(steady, list(range(len(steady))))
    assert fit.slope == pytest.approx(10, rel=0.1), (fit.slope, steady)
    # The unlimited keys, published at the same time, are not held back by it.
    free_done = max(e.finished for e in entries if e.tenant != "slow")
    assert free_done < slow[20], (free_done - slow[0], slow[20] - slow[0])
    # Telemetry: each task carries its key's weight, and the time its key was
    # throttled reaches the telemetry whole, told by the key's next served task.
    rows = [r for r in pq.read_table(telemetry).to_pylist() if r["outcome"] == "success"]
    assert len(rows) == 280
    weights = {r["fair_key"]: r["key_weight"] for r in rows}
    assert weights == {"slow": 1.0, "free0": 3.0, "free1": 1.0, "free2": 1.0, "free3": 1.0}
    throttled = {k: sum(r["key_throttled"] for r in rows if r["fair_key"] == k) for k in weights}
    assert throttled["slow"] == pytest.approx(limits["throttled_seconds"], rel=1e-6), (
        throttled, limits,
    )  # fmt: skip
    assert all(throttled[k] == 0 for k in weights if k != "slow"), throttled
    assert sum(1 for r in rows if r["fair_key"] == "slow" and r["key_throttled"] > 0) >= 20


def test_a_killed_workers_slots_come_back_and_nothing_is_lost(
    redis_url: str, producer: Celery
) -> None:
    publish_by_key(producer, QUEUE, {"solo": 12}, ms=300)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    ledger = Ledger(redis_url)
    env = {
        "CELERY_FAIR_KEY_CONCURRENCY": "solo=1",
        "CELERY_FAIR_KEY_LEASE_TTL": "3",
        "CELERY_FAIR_ACKS_LATE": "1",
        "CELERY_FAIR_VISIBILITY": "3",
    }
    first = _worker(redis_url, 2, **env).start()
    try:
        assert ledger.wait_for(2, timeout=60, alive=[first]), first.log()[-3000:]
        # The key's one slot, held by the running task (between one task's end
        # and the next one's fetch, briefly by none).
        deadline = time.monotonic() + 10
        while len(held := client.hkeys(names.lease_keys)) != 1:
            assert len(held) < 2 and time.monotonic() < deadline, held
            time.sleep(0.01)
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
    finally:
        first.stop()
    with _worker(redis_url, 2, **env) as second:
        # The dead worker's lease expires (3 s) and its task is restored.
        deadline = time.monotonic() + 60
        while len({e.id for e in ledger.entries()}) < 12:
            assert time.monotonic() < deadline, second.log()[-3000:]
            assert second.proc is not None and second.proc.poll() is None, second.log()[-3000:]
            time.sleep(0.2)
        # Every slot back: the ledger has a task's entry before its worker releases
        # the slot (the task writes it), so the last release may still be on its way.
        assert poll_until(lambda: client.hget(names.running, "solo") is None, 10), client.hgetall(
            names.running
        )
    runs = {e.id: e for e in ledger.entries()}
    assert len(runs) == 12  # nothing lost
    assert most_at_once(list(runs.values()))["solo"] == 1  # the limit held throughout


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_finished_tasks_free_their_slots_and_a_warm_stop_leaves_none_held(
    redis_url: str, producer: Celery, pool: str
) -> None:
    """Prefork's results come on the worker's loop: each release rides on the next
    fetch, and a full worker sends no idle wait per task.  A thread pool's come on
    its threads: they go at once.  Either way, a warm stop leaves no slot held
    (a lease lasts 300 s by default: one left behind would hold its key that long)."""
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    ledger = Ledger(redis_url)
    fast = {f"k{i}": 20 for i in range(4)}
    publish_by_key(producer, QUEUE, fast, ms=20)
    env = {"CELERY_FAIR_KEY_CONCURRENCY": "*=1"}
    with _worker(redis_url, 2, pool, **env) as worker:
        assert ledger.wait_for(80, timeout=120, alive=[worker]), worker.log()[-3000:]
        stats = wait_fair_stats(redis_url)
        slow = {f"s{i}": 3 for i in range(4)}
        publish_by_key(producer, QUEUE, slow, ms=500)
        deadline = time.monotonic() + 30
        while client.hlen(names.lease_keys) < 2:  # two slow tasks hold their slots
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.02)
        assert worker.stop() == 0, worker.log()[-3000:]
    assert client.hgetall(names.running) == {} and client.hlen(names.lease_keys) == 0
    most = most_at_once(ledger.entries())
    assert set(most) <= {*fast, *slow} and max(most.values()) == 1, most
    keyed = stats["keys"]
    assert keyed["released"] >= 80 and keyed["release_errors"] == 0, keyed
    if pool == "prefork":
        # One idle wait per task before releases rode on fetches; now only when
        # the queue runs dry or before the first release.
        assert stats["atomic_fetch"]["waits"] < 20, stats["atomic_fetch"]
    with _worker(redis_url, 2, pool, **env) as again:  # what the stop put back runs
        assert ledger.wait_for(92, timeout=60, alive=[again]), again.log()[-3000:]
    assert len({e.id for e in ledger.entries()}) == 92
