"""Nothing waits for the pool's maintenance when every prefork child is replaced at once.

Celery's prefork pool learns that a child exited when the child's sentinel
pipe becomes readable; read in the moment between the pipe's close and the
child becoming joinable, the exit is joined by nobody, and the replacement
waits for the pool's 5 s maintenance timer (celery#9588).  When both children
of a ``-c 2 --max-tasks-per-child`` worker reach the limit together, no task
runs in between: on RabbitMQ, celery-fair's worker ran into it in every run of
3,000 tasks (1 to 20 tasks waited 2.2-4 s; plain Celery 0-1 in three runs).
celery-fair looks at such a child again until it can be joined
(``compat.follow_process_exits``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.churn import task_waits
from tests.harness.harness import WorkerProcess, poll_until
from tests.integration.production_app import make_app

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]

#: The churn soak's worker ``b`` without the churn: Celery's defaults and the
#: flags deployments use.
FLAGS = ("-E", "-O", "fair", "--time-limit=1.5", "--max-tasks-per-child=20")
QUEUES = {"rep_hi": 4, "rep_lo": 1}
#: 150 replacements of each child: the stall came 1-20 times per run.
TASKS = 3000
#: Plain Celery's longest wait in these runs was 0.6-0.7 s; a missed exit costs 2-5 s.
LONGEST = 2.0


def test_children_replaced_together_are_replaced_at_once(
    rabbitmq_server: Any, redis_url: str
) -> None:
    env = {
        "CELERY_FAIR_BROKER": rabbitmq_server.url,
        "PRODUCTION_BACKEND": redis_url.rsplit("/", 1)[0] + "/1",
        "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in QUEUES.items()),
    }
    producer = make_app({**env, "PRODUCTION_BACKEND": ""}, name="replacement-producer")
    try:
        with producer.producer_or_acquire() as p:
            for _ in range(TASKS // len(QUEUES)):
                for q in QUEUES:
                    producer.send_task(
                        "prod.churn", args=(q,), kwargs={"ms": 2}, queue=q, producer=p
                    )
    finally:
        producer.close()
    worker = WorkerProcess(
        rabbitmq_server.url, list(QUEUES), app="tests.integration.production_app", env=env,
        extra_args=FLAGS,
    )  # fmt: skip
    with worker:
        assert poll_until(lambda: worker.log().count(" succeeded ") >= TASKS, timeout=300), (
            worker.log()[-3000:]
        )
        log = worker.log()
    waits = task_waits(log)
    assert len(waits) == TASKS
    # The children were replaced about TASKS / 20 times.
    children = {line.split("/ForkPoolWorker-")[1].split("]")[0] for line in log.splitlines()
                if "/ForkPoolWorker-" in line}  # fmt: skip
    assert len(children) >= TASKS // 20 - 10, len(children)
    late = sorted(w for w in waits if w > LONGEST)
    assert not late, f"{len(late)} tasks waited over {LONGEST} s: {late[-5:]}"
    assert "celery.pool.process_exits" not in log  # the probe found what it follows
