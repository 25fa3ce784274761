"""Celery 5.6's ``worker_disable_prefetch`` and ``worker_eta_task_limit`` with celery-fair.

* ``worker_disable_prefetch`` (Redis): Celery's ``can_consume`` lets the
  worker fetch only when a pool slot is free.  The fetch is still celery-fair's
  (atomic, in DWRR order), so every fetch is a weighted decision: the shares
  hold and the worker holds no more tasks than it has slots.  ``fair_prefetch``
  (a window to size) contradicts it and is refused at start.
* ``worker_eta_task_limit``: ETA tasks wait in the worker, held against the
  prefetch window; Celery caps how far it raises the window for them.  They
  all run, none lost, and the other tasks keep their shares.
"""

from __future__ import annotations

import json
import time

import pytest
import redis as redis_lib
from celery import __version__ as celery_version

from tests.harness.control import control_app, wait_fair_stats
from tests.harness.harness import WorkerProcess, fill_queues, run_backlogged

pytestmark = [
    pytest.mark.integration,
    pytest.mark.compat,
    pytest.mark.skipif(
        tuple(int(p) for p in celery_version.split(".")[:2]) < (5, 6),
        reason="worker_disable_prefetch and worker_eta_task_limit are Celery >= 5.6 settings",
    ),
]

WEIGHTS = {"da": 1, "db": 3}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in WEIGHTS.items())


def test_disabled_prefetch_keeps_the_shares_and_holds_one_task_per_slot(redis_url: str) -> None:
    result = run_backlogged(
        redis_url,
        dict.fromkeys(WEIGHTS, 1500),
        target=1000,
        warmup=100,
        task="nap",
        args=(2,),
        env={"CELERY_FAIR_DISABLE_PREFETCH": "1"},
        extra_args=["--fair-weights", WEIGHT_ARG],
    )
    assert result.shares()["db"] == pytest.approx(0.75, abs=0.03), result.shares()


def test_disabled_prefetch_fetches_only_for_a_free_slot(redis_url: str) -> None:
    fill_queues(redis_url, dict.fromkeys(WEIGHTS, 200), task="nap", args=(50,))
    env = {"CELERY_FAIR_DISABLE_PREFETCH": "1"}
    with WorkerProcess(redis_url, list(WEIGHTS), env=env, concurrency=2) as worker:
        held = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = wait_fair_stats(redis_url)
            held.append(sum(stats["held"].values()))
        assert worker.proc is not None and worker.proc.poll() is None
    # Two slots: never more than two tasks out of Redis (plain prefetch holds 8).
    assert max(held) <= 2 and max(held) >= 1, held


def test_fair_prefetch_with_disabled_prefetch_is_refused_at_start(redis_url: str) -> None:
    env = {"CELERY_FAIR_DISABLE_PREFETCH": "1", "CELERY_FAIR_PREFETCH": "auto"}
    worker = WorkerProcess(redis_url, list(WEIGHTS), env=env).start()
    try:
        status = worker.wait(timeout=60)
    finally:
        worker.stop()
    log = worker.log()
    assert status != 0 and "fair_prefetch='auto'" in log and "worker_disable_prefetch" in log


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_eta_tasks_under_a_limit_all_run_beside_weighted_queues(
    request: pytest.FixtureRequest, broker: str
) -> None:
    url = request.getfixturevalue("redis_server" if broker == "redis" else "rabbitmq_server").url
    # redis_url: the session's Redis, flushed after the test, so that no ledger
    # entry is left for the next test to count.
    ledger_url = request.getfixturevalue("redis_url")
    ledger = redis_lib.Redis.from_url(ledger_url)
    ledger.delete("ledger")
    env = {"CELERY_FAIR_LEDGER": ledger_url, "CELERY_FAIR_ETA_LIMIT": "5"}
    producer = control_app(url)  # a fresh app: Celery caches the first broker URL
    with WorkerProcess(url, list(WEIGHTS), env=env, extra_args=["--fair-weights", WEIGHT_ARG]):
        ids = [
            producer.send_task("ledger", args=(1,), queue=q, countdown=2).id
            for q in WEIGHTS
            for _ in range(20)
        ]
        deadline = time.monotonic() + 60
        while ledger.llen("ledger") < len(ids):
            assert time.monotonic() < deadline, ledger.llen("ledger")
            time.sleep(0.1)
    ran = [json.loads(e)["id"] for e in ledger.lrange("ledger", 0, -1)]
    assert sorted(ran) == sorted(ids)  # every ETA task ran, once
    producer.close()
