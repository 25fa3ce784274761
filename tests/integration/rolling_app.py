"""Two releases of one project, for the bad-input tests.

``ROLLING_RELEASE=old`` knows only ``old_task``; ``new`` also knows
``new_task``.  Each run is recorded in Redis (``ROLLING_LEDGER``): the set
``ran:<task>`` holds the arguments that ran, the hash ``ran:by`` counts runs
per release.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

import celery_fair

RELEASE = os.environ.get("ROLLING_RELEASE", "new")

app = Celery("rolling_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CELERY_FAIR_BROKER", "redis://127.0.0.1:6379/0"),
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
    broker_connection_retry_on_startup=True,
    fair_unknown_task_delay=float(os.environ.get("ROLLING_DELAY", "0.5")),
    fair_unknown_task_max_returns=int(os.environ.get("ROLLING_MAX_RETURNS", "30")),
)
if os.environ.get("ROLLING_KEYPREFIX"):
    app.conf.broker_transport_options = {"global_keyprefix": os.environ["ROLLING_KEYPREFIX"]}
if os.environ.get("CELERY_FAIR", "1") == "1":
    celery_fair.install(app)

_ledger: redis.Redis | None = None


def _record(task: str, n: int) -> None:
    global _ledger
    if _ledger is None:
        _ledger = redis.Redis.from_url(os.environ["ROLLING_LEDGER"])
    pipe = _ledger.pipeline(transaction=False)
    pipe.sadd(f"ran:{task}", n)
    pipe.hincrby("ran:by", f"{task}:{RELEASE}", 1)
    pipe.execute()


@app.task(name="old_task", shared=False)
def old_task(n: int) -> None:
    _record("old_task", n)


if RELEASE == "new":

    @app.task(name="new_task", shared=False)
    def new_task(n: int) -> None:
        _record("new_task", n)
