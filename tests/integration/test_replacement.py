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

from tests.harness.churn import log_around, task_times
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


def test_children_replaced_together_are_replaced_at_once(rabbitmq_server: Any) -> None:
    env = {
        "CELERY_FAIR_BROKER": rabbitmq_server.url,
        # No result backend: the test reads the worker's log, and a store into
        # the session's shared Redis would add that server's pauses to the waits.
        "PRODUCTION_BACKEND": "",
        "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in QUEUES.items()),
    }
    producer = make_app(env, name="replacement-producer")
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
    times = task_times(log)
    assert len(times) == TASKS
    # The children were replaced about TASKS / 20 times.
    children = {line.split("/ForkPoolWorker-")[1].split("]")[0] for line in log.splitlines()
                if "/ForkPoolWorker-" in line}  # fmt: skip
    assert len(children) >= TASKS // 20 - 10, len(children)
    late = sorted((done - at, at) for at, done in times.values() if done - at > LONGEST)
    assert not late, (
        f"{len(late)} tasks waited over {LONGEST} s: {[round(w, 3) for w, _ in late[-5:]]}; "
        "the worker's log around the longest:\n"
        + "\n".join(log_around(log, late[-1][1], before=1.0, after=late[-1][0] + 0.5, most=80))
    )
    assert "celery.pool.process_exits" not in log  # the probe found what it follows
