"""A project with scheduled tasks (countdown, eta, retry) for the ``fair_eta`` tests.

``CELERY_FAIR_BROKER``  broker URL
``SCHED_ETA``           the ``fair_eta`` setting (unset: Celery's default behaviour)
``SCHED_KEYS``          ``fair_keys`` as ``queue=spec`` (unset: no keyed queue)
``SCHED_LEDGER``        Redis URL of the list ``sched.ran``: one JSON record per run
``SCHED_FAIR``          "0": plain Celery, without ``celery_fair.install``
``SCHED_VISIBILITY``    Redis ``visibility_timeout`` (s), Kombu's restore sweep every second
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

import celery_fair

app = Celery("scheduled_app", broker=os.environ.get("CELERY_FAIR_BROKER"), set_as_current=False)
app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
if os.environ.get("SCHED_ETA"):
    app.conf.fair_eta = os.environ["SCHED_ETA"]
if os.environ.get("SCHED_KEYS"):
    queue, spec = os.environ["SCHED_KEYS"].split("=", 1)
    app.conf.fair_keys = {queue: spec}
if os.environ.get("SCHED_VISIBILITY"):
    # Kombu's option names (kombu/transport/redis.py): a sweep at every call, every second.
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["SCHED_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if os.environ.get("SCHED_FAIR", "1") == "1":
    celery_fair.install(app)


def _ledger(request: Any, n: int) -> None:
    """Record a run: when it started, the eta it carried, the due time celery-fair stamped."""
    entry = {
        "n": n,
        "start": time.time(),
        "eta": request.eta,
        "due": getattr(request, "fair_due", None),
        "retries": request.retries,
    }
    redis.Redis.from_url(os.environ["SCHED_LEDGER"]).rpush("sched.ran", json.dumps(entry))


@app.task(name="sched.record", bind=True)
def record(self: Any, n: int, tenant_id: str = "") -> int:
    _ledger(self.request, n)
    return n


@app.task(name="sched.retry_later", bind=True, max_retries=1)
def retry_later(self: Any, n: int, countdown: float) -> int:
    """Run once, retry after ``countdown`` seconds, run again: record both runs."""
    _ledger(self.request, n)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return n


@signals.task_revoked.connect
def _revoked(request: Any = None, expired: bool = False, **_: Any) -> None:
    """Record a task the worker discarded (an expired one: ``expires`` passed)."""
    entry = {"id": getattr(request, "id", None), "expired": bool(expired)}
    redis.Redis.from_url(os.environ["SCHED_LEDGER"]).rpush("sched.revoked", json.dumps(entry))
