"""A small Celery project with celery-fair, as the example tests of ``test_fair.py`` test it.

Two report queues that share the worker 4:1 (``fair_weights``), and a keyed
queue ``jobs`` fair between tenants (``fair_keys``), with at most one task of a
tenant running at once and two of the tenant ``big`` (``fair_key_concurrency``).
The broker URL is your deployment's; the tests run the worker with ``-b`` and
point this app at the test broker, so nothing here is for tests only.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_fair

app = Celery("proj", broker=os.environ.get("PROJ_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.task_ignore_result = True
app.conf.fair_weights = {"p0": 4, "p1": 1}
app.conf.fair_keys = {"jobs": "tenant_id"}
app.conf.fair_key_concurrency = {"*": 1, "big": 2}
app.conf.task_routes = {"proj.job": {"queue": "jobs"}}
celery_fair.install(app)


@app.task
def report(ms: float = 5.0) -> None:
    """A report: ``ms`` milliseconds of waiting (on a database, say)."""
    time.sleep(ms / 1000)


@app.task
def job(tenant_id: str, ms: float = 50.0) -> None:
    """A tenant's job in the keyed queue ``jobs``."""
    time.sleep(ms / 1000)
