"""celery-fair in Celery's in-process test worker (``celery.contrib.testing``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

import celery_fair
from tests.harness.redis import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def celery_config(redis_server: RedisServer) -> dict[str, Any]:
    # Celery's celery_app fixture builds its app from this configuration.
    return {
        "broker_url": redis_server.url,
        "task_ignore_result": True,
        "fair_weights": {"heavy": 3, "light": 1},
        "worker_prefetch_multiplier": 1,
    }


@pytest.fixture(autouse=True)
def _root_log_level_kept() -> Iterator[None]:
    # start_worker sets the root logger to its own level (ERROR by default); the
    # tests that follow in this process read warnings through caplog.
    level = logging.root.level
    yield
    logging.root.setLevel(level)


def test_in_process_worker_runs_fair_and_reports(
    celery_app: Any, redis_server: RedisServer
) -> None:
    celery_fair.install(celery_app)
    done: list[str] = []

    @celery_app.task(name="record")
    def record(queue: str) -> None:
        done.append(queue)

    with start_worker(celery_app, pool="solo", perform_ping_check=False, queues=["heavy", "light"]):
        for _ in range(20):
            record.apply_async(("heavy",), queue="heavy")
            record.apply_async(("light",), queue="light")
        deadline = time.monotonic() + 30
        while len(done) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        replies = celery_app.control.inspect(timeout=2, limit=1)._request("fair_stats")
    assert sorted(done) == ["heavy"] * 20 + ["light"] * 20
    stats = next(iter(replies.values()))
    assert stats["weights"] == {"heavy": 3.0, "light": 1.0}
    assert stats["fetched"] == {"heavy": 20, "light": 20}
