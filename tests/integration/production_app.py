"""A project configured the way deployments configure it, for the production-command tests.

``celery -A tests.integration.production_app worker`` runs it as users run
theirs: Celery's logging, late acknowledgement with a prefetch multiplier of 1,
a Redis result backend, weights (and keys) in the settings, an optional
``visibility_timeout`` and a beat schedule.  :func:`make_app` builds the same
app from a mapping, so a test can be its producer.

Configured from the environment (like ``tests.harness.workload``):

``CELERY_FAIR_BROKER``      broker URL
``CELERY_FAIR``             "0" for plain Celery (default "1": ``celery_fair.install``)
``PRODUCTION_BACKEND``      the ``result_backend`` (a Redis URL)
``PRODUCTION_ACKS_LATE``    "0": Celery's early acks (default: late, prefetch multiplier 1)
``PRODUCTION_LEDGER``       Redis URL where every task run is recorded (the list ``ledger``)
``PRODUCTION_WEIGHTS``      the ``fair_weights`` setting, as ``q=w,q=w``
``PRODUCTION_KEYS``         the ``fair_keys`` setting, as ``queue=argument[,queue=argument]``
``PRODUCTION_KEY_WEIGHTS``  the ``fair_key_weights`` setting, as ``key=w,key=w``
``PRODUCTION_KEY_MAX_BACKLOG``  the ``fair_key_max_backlog`` setting, as ``key=n,key=n``
``PRODUCTION_VISIBILITY``   ``broker_transport_options['visibility_timeout']`` (s, Redis)
``PRODUCTION_MEMORY_HIGH``  the producer's ``fair_broker_memory_high`` (admission)
``PRODUCTION_CAPACITY``     the ``fair_capacity`` setting, as ``name=amount,...``
``PRODUCTION_QUEUE_CONCURRENCY``  the ``fair_queue_concurrency`` setting, as ``q=n,q=n``
``PRODUCTION_COST``         the ``fair_cost`` setting
``PRODUCTION_MAX_PRIORITY``  Celery's ``task_queue_max_priority``
``PRODUCTION_PRIORITY``     the ``fair_priority`` setting (``strict`` or ``weighted``)
``PRODUCTION_BEAT``         a beat entry sends ``record("tick")`` every so many seconds
``PRODUCTION_BEAT_QUEUE``   ... to this queue

Every run of a task appends one JSON entry to the ledger: the task id and name,
its value, the attempt (``retries``), the queue it came from, the worker and
the process that ran it, its tenant and ETA, and when it started and finished.
The hash ``ledger:queues`` counts the runs per queue.  ``prod.churn`` also notes each
start, before it sleeps, in the list ``ledger:starts``: a run killed mid-task (a hard
time limit, a SIGKILLed pool process, a revoke with terminate) leaves a start and no run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery

import celery_fair
from tests.harness.ledger import record_entry

__all__ = ("app", "make_app")


def _pairs(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


def _ledger() -> str | None:
    """The ledger's Redis URL (``PRODUCTION_LEDGER``), or None."""
    return os.environ.get("PRODUCTION_LEDGER") or None


def _record(task: Any, value: object, tenant_id: str | None, started: float) -> None:
    url = _ledger()
    if url is None:
        return
    request = task.request
    delivery = getattr(request, "delivery_info", None) or {}
    entry = {
        "id": request.id,
        "name": task.name,
        "value": value,
        "retries": int(request.retries or 0),
        "queue": delivery.get("routing_key"),
        "worker": request.hostname,
        "pid": os.getpid(),
        "tenant": tenant_id,
        "eta": None if request.eta is None else str(request.eta),
        "started": started,
        "finished": time.time(),
    }
    record_entry(url, "ledger", entry, count=("ledger:queues", str(entry["queue"])))


def _record_start(task: Any, tenant_id: str | None, started: float) -> None:
    """Note that a run of ``task`` started (``ledger:starts``), before it does its work."""
    url = _ledger()
    if url is None:
        return
    request = task.request
    delivery = getattr(request, "delivery_info", None) or {}
    entry = {
        "id": request.id,
        "queue": delivery.get("routing_key"),
        "worker": request.hostname,
        "pid": os.getpid(),
        "tenant": tenant_id,
        "started": started,
    }
    record_entry(url, "ledger:starts", entry)


def make_app(env: Mapping[str, str] = os.environ, name: str = "production_app") -> Celery:
    """The project's app, configured from ``env``."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=env.get("CELERY_FAIR_BROKER", "redis://127.0.0.1:6379/0"),
        result_backend=env.get("PRODUCTION_BACKEND") or None,
        broker_connection_retry_on_startup=True,
    )
    if env.get("PRODUCTION_ACKS_LATE", "1") == "1":
        app.conf.task_acks_late = True
        app.conf.worker_prefetch_multiplier = 1
    if env.get("PRODUCTION_VISIBILITY"):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(env["PRODUCTION_VISIBILITY"]),
        }
    if env.get("PRODUCTION_WEIGHTS"):
        app.conf.fair_weights = {q: float(w) for q, w in _pairs(env["PRODUCTION_WEIGHTS"]).items()}
    if env.get("PRODUCTION_KEYS"):
        app.conf.fair_keys = _pairs(env["PRODUCTION_KEYS"])
    if env.get("PRODUCTION_KEY_WEIGHTS"):
        app.conf.fair_key_weights = {
            k: float(w) for k, w in _pairs(env["PRODUCTION_KEY_WEIGHTS"]).items()
        }
    if env.get("PRODUCTION_KEY_CONCURRENCY"):
        app.conf.fair_key_concurrency = env["PRODUCTION_KEY_CONCURRENCY"]
    if env.get("PRODUCTION_KEY_MAX_BACKLOG"):
        app.conf.fair_key_max_backlog = env["PRODUCTION_KEY_MAX_BACKLOG"]
    if env.get("PRODUCTION_MEMORY_HIGH"):
        app.conf.fair_broker_memory_high = float(env["PRODUCTION_MEMORY_HIGH"])
    if env.get("PRODUCTION_CAPACITY"):
        app.conf.fair_capacity = {
            r: float(n) for r, n in _pairs(env["PRODUCTION_CAPACITY"]).items()
        }
    if env.get("PRODUCTION_QUEUE_CONCURRENCY"):
        app.conf.fair_queue_concurrency = {
            q: int(n) for q, n in _pairs(env["PRODUCTION_QUEUE_CONCURRENCY"]).items()
        }
    if env.get("PRODUCTION_COST"):
        app.conf.fair_cost = env["PRODUCTION_COST"]
    if env.get("PRODUCTION_MAX_PRIORITY"):
        app.conf.task_queue_max_priority = int(env["PRODUCTION_MAX_PRIORITY"])
    if env.get("PRODUCTION_PRIORITY"):
        app.conf.fair_priority = env["PRODUCTION_PRIORITY"]
    if env.get("PRODUCTION_BEAT"):
        app.conf.beat_schedule = {
            "tick": {
                "task": "prod.record",
                "schedule": float(env["PRODUCTION_BEAT"]),
                "args": ("tick",),
                "options": {"queue": env.get("PRODUCTION_BEAT_QUEUE", "celery")},
            }
        }
    if env.get("CELERY_FAIR", "1") == "1":
        celery_fair.install(app)

    @app.task(name="prod.record", bind=True, shared=False)
    def record(self: Any, value: object, ms: float = 0.0, tenant_id: str | None = None) -> object:
        """Sleep ``ms``, record the run, return ``value``."""
        started = time.time()
        if ms:
            time.sleep(ms / 1000.0)
        _record(self, value, tenant_id, started)
        return value

    @app.task(name="prod.churn", bind=True, shared=False)
    def churn(self: Any, value: object, ms: float = 0.0, tenant_id: str | None = None) -> object:
        """``record``, with its start noted first: a run killed while it sleeps is seen."""
        started = time.time()
        _record_start(self, tenant_id, started)
        if ms:
            time.sleep(ms / 1000.0)
        _record(self, value, tenant_id, started)
        return value

    @app.task(name="prod.flaky", bind=True, shared=False, max_retries=3)
    def flaky(self: Any, value: object) -> object:
        """Record the run; the first attempt asks for a retry in one second."""
        _record(self, value, None, time.time())
        if not self.request.retries:
            raise self.retry(countdown=1)
        return value

    @app.task(name="prod.total", bind=True, shared=False)
    def total(self: Any, values: list[int]) -> int:
        """A chord's body: record the run, return the sum of the header's results."""
        _record(self, sorted(values), None, time.time())
        return sum(values)

    return app


app = make_app()
