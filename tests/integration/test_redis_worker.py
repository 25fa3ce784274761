"""Weighted polling on Redis, with the real ``celery worker`` command."""

from __future__ import annotations

import time

import pytest
import redis as redis_lib

from tests.harness.control import wait_fair_stats
from tests.harness.harness import QUICK_STOP, WorkerProcess, fill_queues, run_backlogged

pytestmark = [pytest.mark.integration, pytest.mark.compat]

WEIGHTS = {"w1": 1, "w2": 2, "w3": 3, "w4": 4}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in WEIGHTS.items())


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent", "eventlet"])
def test_shares_follow_weights(redis_url: str, pool: str) -> None:
    result = run_backlogged(
        redis_url,
        dict.fromkeys(WEIGHTS, 900),
        target=1500,
        warmup=50,
        pool=pool,
        extra_args=["--fair-weights", WEIGHT_ARG],
    )
    shares = result.shares()
    for queue, weight in WEIGHTS.items():
        assert shares[queue] == pytest.approx(weight / 10, abs=0.02), (queue, shares)


def test_plain_celery_flattens_the_same_workload(redis_url: str) -> None:
    # The anchor: without celery-fair, Redis polling is round-robin, 1:1.
    result = run_backlogged(
        redis_url, dict.fromkeys(WEIGHTS, 900), target=1500, warmup=50, fair=False
    )
    for share in result.shares().values():
        assert share == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_runtime_cost_splits_worker_time(redis_url: str, pool: str) -> None:
    fill_queues(redis_url, {"long": 300, "short": 3000}, args={"long": (8000,), "short": (800,)})
    with WorkerProcess(
        redis_url, ["long", "short"], pool=pool, env={"CELERY_FAIR_COST": "runtime"}
    ) as worker:
        _wait_consumed(redis_url, {"long": 300, "short": 3000}, 1200, worker)
        stats = wait_fair_stats(redis_url)
        worker.stop(QUICK_STOP)  # measured
    served = {q: s["served_cost"] for q, s in stats["drr"]["queues"].items()}
    counts = stats["fetched"]
    assert served["long"] / (served["long"] + served["short"]) == pytest.approx(0.5, abs=0.05)
    # The short queue completes about ten times as many tasks.
    assert 6 < counts["short"] / counts["long"] < 12


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_pool_keeps_fetching_while_its_tasks_yield(redis_url: str, pool: str) -> None:
    # Tasks that sleep (I/O) yield to the event loop.  Once the prefetch window was
    # full, the loop waited out Celery's 2 s drain before it saw the credit the
    # finished tasks had returned: about 5 tasks a second, so these 400 took about
    # 80 s.  The deadline is far above what a worker that keeps fetching needs
    # (2 slots, 5 ms each: about a second of sleeping) and far below that.
    fill_queues(redis_url, {"ga": 200, "gb": 200}, task="nap", args=(5,))
    with WorkerProcess(redis_url, ["ga", "gb"], pool=pool) as worker:
        _wait_consumed(redis_url, {"ga": 200, "gb": 200}, 400, worker, timeout=30)


def test_count_cost_counts_are_one_to_one(redis_url: str) -> None:
    result = run_backlogged(
        redis_url,
        {"long": 400, "short": 400},
        target=300,
        warmup=10,
        task="nap",
        args={"long": (5,), "short": (0.5,)},
    )
    assert result.consumed["long"] / result.total == pytest.approx(0.5, abs=0.04)


def _wait_consumed(
    url: str, initial: dict[str, int], n: int, worker: WorkerProcess, timeout: float = 120
) -> None:
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
        if sum(initial[q] - client.llen(q) for q in initial) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker did not consume {n} tasks:\n{worker.log()[-2000:]}")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--fair-weights", "w1=abc"], {}, "--fair-weights['w1'] must be a positive number"),
        (["--fair-weights", "w1"], {}, "--fair-weights: expected QUEUE=WEIGHT"),
        ([], {"CELERY_FAIR_WEIGHTS": "w1=-3"}, "fair_weights['w1'] must be a positive number"),
        ([], {"CELERY_FAIR_COST": "wallclock"}, "fair_cost must be one of 'count', 'runtime'"),
        (
            [],
            {"CELERY_FAIR_KEYS": "w1=args:0"},
            "Error: fair_keys['w1']='args:0': key='args:0': unknown key source 'args'",
        ),
    ],
)
def test_bad_settings_stop_the_worker_at_start(
    redis_url: str, args: list[str], env: dict[str, str], message: str
) -> None:
    worker = WorkerProcess(redis_url, ["w1"], extra_args=args, env=env).start()
    try:
        assert worker.wait(timeout=60) != 0
    finally:
        worker.stop()
    log = worker.log()
    assert message in log
    # One line at start, not a traceback while the app module is imported.
    assert "Unable to load celery application" not in log and "Traceback" not in log


def test_weights_change_at_run_time(redis_url: str) -> None:
    import redis

    from tests.harness.control import control_app

    fill_queues(redis_url, {"a": 2000, "b": 2000}, task="nap", args=(5,))
    client = redis.Redis.from_url(redis_url)
    with WorkerProcess(redis_url, ["a", "b"]) as worker:
        _wait_consumed(redis_url, {"a": 2000, "b": 2000}, 50, worker)
        app = control_app(redis_url)
        replies = app.control.broadcast(
            "fair_weights", arguments={"weights": ["a=x"]}, reply=True, timeout=5, limit=1
        )
        assert "error" in next(iter(replies[0].values()))
        replies = app.control.broadcast(
            "fair_weights", arguments={"weights": ["a=3", "b=1"]}, reply=True, timeout=5, limit=1
        )
        assert "ok" in next(iter(replies[0].values()))
        before = {q: client.llen(q) for q in "ab"}
        _wait_consumed(redis_url, before, 600, worker)
        after = {q: client.llen(q) for q in "ab"}
    consumed = {q: before[q] - after[q] for q in "ab"}
    assert consumed["a"] / sum(consumed.values()) == pytest.approx(0.75, abs=0.04)
    # The live weights are kept on the broker: a worker started later (a restart,
    # configured with no weights) serves by them, not by its configuration.
    from tests.harness.control import wait_fair_stats

    with WorkerProcess(redis_url, ["a", "b"]) as restarted:
        stats = wait_fair_stats(redis_url)
        assert stats["weights"] == {"a": 3.0, "b": 1.0}, stats["weights"]
        before = {q: client.llen(q) for q in "ab"}
        _wait_consumed(redis_url, before, 400, restarted)
        after = {q: client.llen(q) for q in "ab"}
    consumed = {q: before[q] - after[q] for q in "ab"}
    assert consumed["a"] / sum(consumed.values()) == pytest.approx(0.75, abs=0.05)


def test_a_live_weight_for_a_queue_not_consumed_is_named_and_all_can_be_cleared(
    redis_url: str,
) -> None:
    from tests.harness.control import control_app, wait_fair_stats

    with WorkerProcess(redis_url, ["a", "b"]) as worker:
        wait_fair_stats(redis_url)
        app = control_app(redis_url)

        def send(*words: str) -> dict[str, str]:
            replies = app.control.broadcast(
                "fair_weights", arguments={"weights": list(words)}, reply=True, timeout=5, limit=1
            )
            return dict(next(iter(replies[0].values())))

        reply = send("a=3", "nosuchqueue=3")
        assert "ok" in reply and "does not consume nosuchqueue" in reply["warning"], reply
        client = redis_lib.Redis.from_url(redis_url)
        assert client.hgetall("_fair.queue_weights") == {b"a": b"3.0", b"nosuchqueue": b"3.0"}
        reply = send("default")
        assert "live weights cleared" in reply["ok"], reply
        assert client.exists("_fair.queue_weights") == 0
        assert wait_fair_stats(redis_url)["weights"] == {"a": 1.0, "b": 1.0}
        assert worker.proc is not None and worker.proc.poll() is None
