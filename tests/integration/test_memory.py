"""Bounded memory: a worker draining a 100,000-task backlog on Redis."""

from __future__ import annotations

import pytest

from tests.harness.harness import fill_queues
from tests.harness.memory import drain_and_sample
from tests.harness.redis import free_port

pytestmark = pytest.mark.integration

QUEUES = {"b1": 1, "b2": 2, "b3": 3, "b4": 4}
MIB = 1024 * 1024


def test_fair_worker_memory_stays_bounded_like_plain_celery(redis_url: str) -> None:
    pytest.importorskip("prometheus_client")
    runs = {}
    for fair in (False, True):
        # 100,000 tasks queued for each run; 10,000 drained while sampling: state
        # kept per task past 2 KiB fails the bound below (bench.memory drains the
        # whole backlog).
        fill_queues(redis_url, dict.fromkeys(QUEUES, 25_000), task="work", args=(0,))
        env = (
            # Everything that keeps per-task state on: run-time cost (the
            # tracker follows each task to its end), metrics (sojourns).
            {"CELERY_FAIR_COST": "runtime", "CELERY_FAIR_METRICS_PORT": str(free_port())}
            if fair
            else {}
        )
        args = ["--fair-weights", ",".join(f"{q}={w}" for q, w in QUEUES.items())] if fair else []
        runs[fair] = drain_and_sample(
            redis_url, list(QUEUES), drain=11_000, warmup=1_000, fair=fair, env=env, extra_args=args
        )
        import redis

        redis.Redis.from_url(redis_url).flushdb()
    plain, fair_run = runs[False], runs[True]
    summary = {
        "plain": (plain.start_rss / MIB, plain.peak_rss / MIB),
        "fair": (fair_run.start_rss / MIB, fair_run.peak_rss / MIB),
    }
    assert plain.queued == fair_run.queued == 100_000
    # Neither worker loads the backlog: 100,000 messages are ~60 MiB of JSON.
    assert plain.growth < 40 * MIB, summary
    # celery-fair's per-queue and per-task state adds at most a little.
    assert fair_run.growth <= 2 * plain.growth + 10 * MIB, summary
    assert fair_run.peak_rss <= plain.peak_rss + 30 * MIB, summary
