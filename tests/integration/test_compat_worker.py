"""The compatibility probes with real workers: fallbacks that keep the promise, clean refusals.

Also Redis Sentinel: the atomic fetch and its wake-up work through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis as redis_lib

from tests.harness.harness import QUICK_STOP, WorkerProcess, fill_queues
from tests.harness.redis import RedisSentinel, RedisServer, server_kind

pytestmark = [pytest.mark.integration, pytest.mark.compat]

WEIGHTS = {"ca": 1, "cb": 3}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in WEIGHTS.items())


def consume(
    worker: WorkerProcess, client: redis_lib.Redis, filled: dict[str, int], count: int
) -> dict[str, int]:
    """Wait until ``count`` tasks left the queues; what each queue gave."""
    deadline = time.monotonic() + 90
    while True:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        taken = {q: n - int(client.llen(q)) for q, n in filled.items()}
        if sum(taken.values()) >= count:
            return taken
        assert time.monotonic() < deadline, (taken, worker.log()[-3000:])
        time.sleep(0.01)


def calls(client: redis_lib.Redis, command: str) -> int:
    """How often the server ran ``command`` since its statistics were reset."""
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def sentinel(redis_server: RedisServer) -> Iterator[RedisSentinel]:
    with RedisSentinel(redis_server) as found:
        yield found
    redis_lib.Redis.from_url(redis_server.url).flushdb()


def test_the_atomic_fetch_works_through_sentinel(
    redis_server: RedisServer, sentinel: RedisSentinel
) -> None:
    client = redis_lib.Redis.from_url(redis_server.url)
    client.config_resetstat()
    filled = dict.fromkeys(WEIGHTS, 1500)
    fill_queues(redis_server.url, filled, task="work")
    env = {"CELERY_FAIR_MASTER_NAME": sentinel.master_name}
    with WorkerProcess(
        sentinel.url, list(WEIGHTS), env=env, extra_args=["--fair-weights", WEIGHT_ARG]
    ) as worker:
        consume(worker, client, filled, 200)  # warm-up
        before = consume(worker, client, filled, 0)
        after = consume(worker, client, filled, sum(before.values()) + 1200)
        log = worker.log()
        worker.stop(QUICK_STOP)  # measured
    served = {q: after[q] - before[q] for q in WEIGHTS}
    assert served["cb"] / sum(served.values()) == pytest.approx(0.75, abs=0.03), served
    # The fetches were the script's, on the master the sentinel named.  The
    # BRPOPs are mingle's polls of its reply queue, sent before the fetch took
    # the channel over (a task fetched by BRPOP would make hundreds).
    assert calls(client, "evalsha") >= 1200 and calls(client, "brpop") <= 3
    # (Kombu < 5.6 logs its one fallback, the fixed BRPOP timeout; the fetch stays atomic.)
    assert "instead: Kombu's own BRPOP fetch" not in log
    # The wake-up listener reached the master the sentinel named (redis-py 6
    # sets a Sentinel pool's address in the pool, not in its connections).
    assert "invalidation listener lost its connection" not in log
    assert "celery-fair: DWRR fetch order" in log


def test_a_listener_connection_closed_by_the_server_does_not_stop_the_fetch(
    redis_url: str,
) -> None:
    # A proxy or an operator (CLIENT KILL) closes the invalidation listener's
    # connection. It reconnects on its own; the fetch goes on meanwhile. With
    # Kombu < 5.7, a connection of Kombu's own class closing took the Redis
    # poll off the worker's event loop: the worker stayed up and fetched nothing.
    client = redis_lib.Redis.from_url(redis_url)
    filled = dict.fromkeys(WEIGHTS, 1500)
    fill_queues(redis_url, filled, task="work")
    with WorkerProcess(
        redis_url, list(WEIGHTS), extra_args=["--fair-weights", WEIGHT_ARG]
    ) as worker:
        consume(worker, client, filled, 200)
        listeners = [c for c in client.client_list() if int(c.get("sub", 0)) > 0]
        assert len(listeners) == 1, listeners  # the invalidation listener, subscribed
        client.client_kill_filter(_id=listeners[0]["id"])
        before = consume(worker, client, filled, 0)
        after = consume(worker, client, filled, sum(before.values()) + 1200)
        served = {q: after[q] - before[q] for q in WEIGHTS}
        # Idle, then new work: the listener is back and wakes the fetch.
        consume(worker, client, filled, sum(filled.values()))
        fill_queues(redis_url, {"ca": 20}, task="work")
        consume(worker, client, {"ca": 20}, 20)
        log = worker.log()
    assert served["cb"] / sum(served.values()) == pytest.approx(0.75, abs=0.03), served
    assert log.count("invalidation listener lost its connection") == 1, log[-3000:]


def test_a_changed_fetch_signature_falls_back_to_kombus_fetch_and_keeps_the_shares(
    redis_url: str,
) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    client.config_resetstat()
    filled = dict.fromkeys(WEIGHTS, 1500)
    fill_queues(redis_url, filled, task="work")
    url = redis_url.replace("redis://", "fairrenamed://")
    env = {"CELERY_FAIR_COMPAT_FAKE": "renamed-fetch"}
    app = "tests.integration.compat_app"
    args = ["--fair-weights", WEIGHT_ARG]
    with WorkerProcess(url, list(WEIGHTS), app=app, env=env, extra_args=args) as worker:
        before = consume(worker, client, filled, 200)
        after = consume(worker, client, filled, sum(before.values()) + 1200)
        log = worker.log()
        worker.stop(QUICK_STOP)  # measured
    served = {q: after[q] - before[q] for q in WEIGHTS}
    assert served["cb"] / sum(served.values()) == pytest.approx(0.75, abs=0.03), served
    # One line says what was given up; the fetch is Kombu's BRPOP, no script.
    fallback = [line for line in log.splitlines() if "instead: Kombu's own BRPOP fetch" in line]
    assert len(fallback) == 1 and "_q_for_pri(queue, pri)" in fallback[0]
    # (Kombu runs a few scripts of its own: bindings.)
    assert calls(client, "brpop") >= 1200 and calls(client, "evalsha") < 100


def test_a_semaphore_without_its_waiters_stops_the_worker_at_start(redis_url: str) -> None:
    env = {"CELERY_FAIR_COMPAT_FAKE": "renamed-waiters"}
    app = "tests.integration.compat_app"
    worker = WorkerProcess(redis_url, list(WEIGHTS), app=app, env=env).start()
    try:
        status = worker.wait(timeout=60)
    finally:
        worker.stop()
    log = worker.log()
    assert status != 0, log[-3000:]
    assert "celery-fair cannot run with celery " in log and "_waiting" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_the_harness_runs_the_server_asked_for(redis_server: RedisServer) -> None:
    """The matrix's Valkey session really runs Valkey (``CELERY_FAIR_TEST_SERVER``)."""
    info = redis_server.client().info("server")
    assert ("valkey_version" in info) == (server_kind() == "valkey"), info
