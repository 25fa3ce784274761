"""A Redis broker restarted under a running worker: with its data (AOF), and without.

Real ``celery worker`` processes with Celery's defaults (mingle, gossip and
heartbeat on) serve a keyed queue with a per-key concurrency limit of 1 while
the broker is killed and started again on the same port:

* with AOF (``appendfsync always``), every task runs, the limit holds, and
  afterwards the keyed state is consistent: no key stranded out of line, no
  key slot held (the lease TTL is ten minutes, so only a release frees one);
* without persistence, the worker says that the queue lost its state, serves
  what is published next under the same limit, and neither exits nor spins.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.keys import keyed_app, keyed_consistency, most_at_once, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.redis import KOMBU_REPOLLS_AFTER_RESTART, RedisServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.deployment,
    # Kombu before 5.4 can take the Redis poll off the event loop when a worker
    # reconnects after a broker restart: plain Celery's worker then stays up and
    # consumes nothing too (celery#9054, kombu#2007; docs/operations.md).
    pytest.mark.skipif(
        not KOMBU_REPOLLS_AFTER_RESTART,
        reason="Kombu < 5.4 can stop consuming after a broker restart (celery#9054)",
    ),
]

QUEUE = "jobs"
KEYS = [f"t{i}" for i in range(4)]
ENV = {
    "CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id",
    "CELERY_FAIR_KEY_CONCURRENCY": "*=1",
    # Messages a worker held when the connection broke come back after 10 s
    # (Kombu's visibility timeout), but a key slot only by its release: with
    # the lease TTL at ten minutes, a slot still held at the end is a leak.
    "CELERY_FAIR_ACKS_LATE": "1",
    "CELERY_FAIR_VISIBILITY": "10",
    "CELERY_FAIR_KEY_LEASE_TTL": "600",
}


def _settled(client: Any) -> dict[str, Any]:
    """The keyed queue's state once consistent with no lease held (asserted, 30 s at most)."""
    state: dict[str, Any] = {}

    def settled() -> bool:
        state.update(keyed_consistency(client, QUEUE))
        return not state["problems"] and state["leases"] == 0

    assert poll_until(settled, 30), state
    return state


def test_after_a_restart_with_aof_every_task_runs_and_nothing_is_stranded(
    redis_url: str,
) -> None:
    ledger = Ledger(redis_url)
    with RedisServer(appendonly=True) as broker:
        producer = keyed_app(broker.url, {QUEUE: "tenant_id"})
        publish_by_key(producer, QUEUE, dict.fromkeys(KEYS, 12), ms=100)
        env = {**ENV, "CELERY_FAIR_LEDGER": redis_url}
        with WorkerProcess(broker.url, [QUEUE], concurrency=4, env=env) as worker:
            assert ledger.wait_for(10, timeout=60, alive=[worker]), worker.log()[-4000:]
            broker.restart(kill=True)  # SIGKILL: what was fsynced is what comes back
            publish_by_key(producer, QUEUE, dict.fromkeys(KEYS, 3), ms=100)
            # 60 tasks, some run twice (at least once: a task running at the kill).
            ran = lambda: len({e.id for e in ledger.entries()}) >= 60  # noqa: E731
            assert poll_until(ran, 120), worker.log()[-4000:]
            client = broker.client()
            state = _settled(client)
            assert state["waiting"] == 0 and state["running"] == 0, state
            assert worker.proc is not None and worker.proc.poll() is None
            log = worker.log()
        producer.close()
    entries = ledger.entries()
    most = most_at_once(entries)
    assert set(most) == set(KEYS) and max(most.values()) == 1, most
    # Kombu may log a late ack that failed while the broker was away (with its
    # traceback); nothing may stop the worker, and celery-fair logs no error.
    assert "Unrecoverable error" not in log and "ERROR/MainProcess] celery-fair" not in log, log[
        -4000:
    ]
    # Each connection says what it found: at start, and again after the restart.
    assert f"keyed queue '{QUEUE}' found again on the broker" in log, log[-4000:]
    assert "lost its state" not in log, log[-4000:]


def test_after_a_restart_that_lost_the_data_the_worker_says_so_and_goes_on(
    redis_url: str,
) -> None:
    ledger = Ledger(redis_url)
    with RedisServer() as broker:  # no persistence: a restart starts empty
        producer = keyed_app(broker.url, {QUEUE: "tenant_id"})
        publish_by_key(producer, QUEUE, dict.fromkeys(KEYS, 10), ms=100)
        env = {**ENV, "CELERY_FAIR_LEDGER": redis_url}
        with WorkerProcess(broker.url, [QUEUE], concurrency=4, env=env) as worker:
            assert ledger.wait_for(8, timeout=60, alive=[worker]), worker.log()[-4000:]
            broker.restart(kill=True)
            assert poll_until(lambda: "lost its state" in worker.log(), 60), worker.log()[-4000:]
            before = {e.id for e in ledger.entries()}
            publish_by_key(producer, QUEUE, dict.fromkeys(KEYS, 5), ms=100)
            assert poll_until(lambda: len({e.id for e in ledger.entries()} - before) >= 20, 60), (
                worker.log()[-4000:]
            )
            client = broker.client()
            _settled(client)
            # Idle now: a worker that spins would send thousands of commands.
            client.config_resetstat()
            time.sleep(3)  # a measuring window, not a wait for a condition
            calls = sum(v["calls"] for v in client.info("commandstats").values())
            assert calls < 200, client.info("commandstats")
            assert worker.proc is not None and worker.proc.poll() is None
            log = worker.log()
        producer.close()
    after = [e for e in ledger.entries() if e.id not in before]
    most = most_at_once(after)
    assert set(most) == set(KEYS) and max(most.values()) == 1, most
    warning = next(line for line in log.splitlines() if "lost its state" in line)
    assert "WARNING" in warning and "written again" in warning, warning
