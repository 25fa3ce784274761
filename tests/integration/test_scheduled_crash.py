"""Scheduled tasks (``fair_eta = "broker"``) through a broker crash and a worker crash.

``bench.redis_crash_loss``'s scheduled modes in one smaller run: Redis with
AOF (``appendfsync always``), late acks, a 10 s visibility timeout; every task
is sent with an eta and waits in its queue's schedule, due over 8 s.  The
broker is SIGKILLed and restarted on its data after a third ran, the worker
SIGKILLed a quarter later, both while tasks still come due, and another worker
finishes.  Every task runs; a task runs again only when its message was
restored (redelivered), never delivered twice; nothing is left scheduled,
queued or unacknowledged.
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from tests.harness.crash import classify_duplicates, leftovers, schedule_tasks, scheduled_count
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.redis import RedisServer

QUEUES = ["crash-a", "crash-b"]
PER_QUEUE, SPREAD = 150, 8.0
NOTHING = dict.fromkeys(("scheduled", "queued", "unacked", "unacked_index"), 0)


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_nothing_scheduled_is_lost_or_delivered_twice_through_crashes(
    redis_url: str, keyed: bool
) -> None:
    ledger = redis.Redis.from_url(redis_url)
    tasks = PER_QUEUE * len(QUEUES)
    env = {
        "CELERY_FAIR_LEDGER": redis_url,
        "CELERY_FAIR_LEDGER_STARTS": "1",
        "CELERY_FAIR_ACKS_LATE": "1",
        "CELERY_FAIR_VISIBILITY": "10",
    }
    if keyed:
        env["CELERY_FAIR_KEYS"] = ",".join(f"{q}=tenant_id" for q in QUEUES)

    def ran() -> set[str]:
        return {json.loads(e)["id"] for e in ledger.lrange("ledger", 0, -1)}

    with RedisServer(appendonly=True) as broker:
        client = redis.Redis.from_url(broker.url)
        ids = schedule_tasks(broker.url, QUEUES, PER_QUEUE, keyed, time.time() + 3.0, SPREAD)
        assert scheduled_count(client, QUEUES) == tasks, "every task waits in a schedule"
        first = WorkerProcess(broker.url, QUEUES, env=env).start()
        try:
            assert poll_until(lambda: ledger.llen("ledger") >= tasks // 3, 60), first.log()
            at_broker_kill = scheduled_count(client, QUEUES)
            broker.restart(kill=True)
            mark = ledger.llen("ledger")
            assert poll_until(lambda: ledger.llen("ledger") >= mark + tasks // 4, 60), first.log()
            at_worker_kill = scheduled_count(client, QUEUES)
        finally:
            first.kill()
        # The premise: both kills came while messages still waited in a schedule.
        assert at_broker_kill > 0 and at_worker_kill > 0, (at_broker_kill, at_worker_kill)
        with WorkerProcess(broker.url, QUEUES, env=env) as second:
            # Every task, then nothing left: a message the killed worker held is
            # restored past the visibility timeout and runs.
            assert poll_until(lambda: ids <= ran(), 60), second.log()
            assert poll_until(lambda: leftovers(client, QUEUES) == NOTHING, 30), leftovers(
                client, QUEUES
            )
    starts = [json.loads(e) for e in ledger.lrange("ledger:started", 0, -1)]
    ends = [json.loads(e) for e in ledger.lrange("ledger", 0, -1)]
    classes, details = classify_duplicates(ids, starts, ends)
    # Any extra run is a redelivery (a first run killed midway, or finished with
    # its ack lost to a kill); two deliveries without a restore would be a defect.
    assert classes["delivered twice"] == 0, details
