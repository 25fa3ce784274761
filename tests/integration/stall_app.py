"""A project whose pool processes hang at start while a flag file exists.

A user's ``worker_process_init`` handler that blocks (a database that does
not answer, a lock inherited from the parent): Celery kills such a child
after ``worker_proc_alive_timeout`` and forks another, which blocks too, and
the tasks the pool took wait.  The stall watchdog test turns the flag on
once the worker runs.

``CELERY_FAIR_BROKER``    broker URL
``STALL_FLAG``            the flag file's path
``STALL_LEDGER``          Redis URL of the list ``ran`` (each task's value)
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, signals

import celery_fair

app = Celery("stall_app", broker=os.environ.get("CELERY_FAIR_BROKER"), set_as_current=False)
app.conf.fair_weights = {"hi": 4, "lo": 1}
app.conf.fair_stall_after = 2.0
celery_fair.install(app)


@signals.worker_process_init.connect
def hang_while_flagged(**_: object) -> None:
    flag = os.environ.get("STALL_FLAG")
    while flag and os.path.exists(flag):
        time.sleep(0.05)


@app.task(name="stall.record")
def record(value: int) -> int:
    redis.Redis.from_url(os.environ["STALL_LEDGER"]).rpush("ran", value)
    return value
