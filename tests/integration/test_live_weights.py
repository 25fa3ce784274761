"""Live weights (``control fair_weights``) lapse, or are kept, with the real ``celery worker``.

A short TTL, and every wait a poll with a deadline: of the worker's
``fair_stats``, of the broker's hashes, or of the broker's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis as redis_lib

from tests.harness.control import control_app, wait_fair_stats
from tests.harness.harness import WorkerProcess, poll_until

pytestmark = [pytest.mark.integration]

EXPIRY = "_fair.queue_weights.expires"


def _sender(redis_url: str) -> Callable[..., dict[str, str]]:
    app = control_app(redis_url)

    def send(*words: str) -> dict[str, str]:
        replies = app.control.broadcast(
            "fair_weights", arguments={"weights": list(words)}, reply=True, timeout=5, limit=1
        )
        assert replies, "no reply to fair_weights"
        return dict(next(iter(replies[0].values())))

    return send


def _stats_until(redis_url: str, ok: Callable[[dict[str, Any]], bool], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = wait_fair_stats(redis_url)
        if ok(stats):
            return stats
    raise AssertionError(f"fair_stats never as expected within {timeout:g} s: {stats}")


def test_a_live_weight_lapses_back_to_the_settings_and_says_so_once(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    env = {"CELERY_FAIR_WEIGHTS": "a=2", "CELERY_FAIR_LIVE_WEIGHTS_TTL": "5"}
    with WorkerProcess(redis_url, ["a", "b"], env=env) as worker:
        assert wait_fair_stats(redis_url)["weights"] == {"a": 2.0, "b": 1.0}
        send = _sender(redis_url)
        # The setting's TTL (5 s) applies to a command without ttl= or keep.
        reply = send("a=5", "b=4")
        assert "lapse in 5 s" in reply["ok"], reply
        assert set(client.hgetall(EXPIRY)) == {b"a", b"b"}
        stats = wait_fair_stats(redis_url)
        assert set(stats["live_weights_expire_in"]) == {"a", "b"}, stats
        # Once lapsed: the configured weights, and the broker's entries gone.
        stats = _stats_until(redis_url, lambda s: s["weights"] == {"a": 2.0, "b": 1.0}, timeout=30)
        assert stats["live_weights_expire_in"] == {}
        assert poll_until(lambda: not client.exists("_fair.queue_weights", EXPIRY), timeout=10), (
            client.hgetall("_fair.queue_weights")
        )
        assert worker.proc is not None and worker.proc.poll() is None
    log = worker.log()
    assert log.count("live weight(s) expired, back to the configured weights") == 1, log[-3000:]
    assert "a=2 (was 5)" in log and "b=1 (was 4)" in log


def test_keep_outlasts_a_restart_and_clear_removes_it(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    env = {"CELERY_FAIR_LIVE_WEIGHTS_TTL": "2"}
    with WorkerProcess(redis_url, ["a", "b"], env=env):
        wait_fair_stats(redis_url)
        send = _sender(redis_url)
        assert "error" in send("a=3", "ttl=-1")
        assert "error" in send("a=3", "keep=maybe")
        reply = send("a=3", "keep")
        assert "kept until cleared" in reply["ok"], reply
        assert client.hgetall("_fair.queue_weights") == {b"a": b"3.0"}
        assert not client.exists(EXPIRY)
        # Kept: past the setting's TTL (2 s) on the broker's clock, still in force.
        start = client.time()[0]
        assert poll_until(lambda: client.time()[0] >= start + 3, timeout=10)
        assert wait_fair_stats(redis_url)["weights"] == {"a": 3.0, "b": 1.0}
    with WorkerProcess(redis_url, ["a", "b"], env=env) as restarted:
        stats = wait_fair_stats(redis_url)
        assert stats["weights"] == {"a": 3.0, "b": 1.0}, stats
        assert stats["live_weights_expire_in"] == {}
        reply = _sender(redis_url)("clear")
        assert "live weights cleared" in reply["ok"], reply
        assert wait_fair_stats(redis_url)["weights"] == {"a": 1.0, "b": 1.0}
        assert not client.exists("_fair.queue_weights", EXPIRY)
        assert restarted.proc is not None and restarted.proc.poll() is None


def test_a_weight_that_lapsed_while_no_worker_ran_is_not_applied_at_start(
    redis_url: str,
) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    with WorkerProcess(redis_url, ["a", "b"]) as first:
        wait_fair_stats(redis_url)
        send = _sender(redis_url)
        # ttl= for this command only, over the setting's hour; b= for longer.
        assert "lapse in 5 s" in send("a=3", "ttl=5")["ok"]
        assert "lapse in 3600 s" in send("b=4")["ok"]
        # A crash: no worker left to see the weight lapse.
        first.kill()
    until = float(client.hget(EXPIRY, "a") or 0)
    assert until > 0
    assert poll_until(lambda: client.time()[0] > until + 1, timeout=10)
    with WorkerProcess(redis_url, ["a", "b"]) as worker:
        stats = wait_fair_stats(redis_url)
        assert stats["weights"] == {"a": 1.0, "b": 4.0}, stats
        assert 3000 < stats["live_weights_expire_in"]["b"] <= 3600
        assert "a" not in stats["live_weights_expire_in"]
        assert poll_until(lambda: client.hkeys("_fair.queue_weights") == [b"b"], timeout=10)
        assert client.hkeys(EXPIRY) == [b"b"]
    assert "live weight(s) on the broker had expired, not applied: a" in worker.log()
