"""The Celery app used by the demo, the benchmarks and the integration tests.

Configured from the environment so that the same module serves plain Celery
and celery-fair side by side:

``CELERY_FAIR_BROKER``   broker URL
``CELERY_FAIR_BROKER_SSL``  ``broker_use_ssl``, as JSON (``{"ssl_cert_reqs": "required", ...}``)
``CELERY_FAIR``          "1" to install celery-fair, "0" for plain Celery
``CELERY_FAIR_COST``     the ``fair_cost`` setting
``CELERY_FAIR_WEIGHTS``  the ``fair_weights`` setting, as ``p0=4,p1=8``
``CELERY_FAIR_TELEMETRY_DIR``  the ``fair_telemetry_dir`` setting
``CELERY_FAIR_QUORUM_QUEUES``  comma-separated queues to declare as quorum queues
``CELERY_FAIR_DLX_QUEUES``  queues declared with a dead-letter exchange ``dlx``
``CELERY_FAIR_CODEL``  ``target,interval[,action[,max_requeues]]`` (seconds)
``CELERY_FAIR_PREFETCH``  the ``fair_prefetch`` setting (``auto`` or a number)
``CELERY_FAIR_PREFETCH_MULTIPLIER``  ``worker_prefetch_multiplier``
``CELERY_FAIR_LEDGER``  Redis URL where the ``ledger`` task records each run
``CELERY_FAIR_LEDGER_STARTS``  "1": the ``ledger`` task also records each start (``ledger:started``)
``CELERY_FAIR_SLOW_MS``  extra milliseconds every ``ledger`` task sleeps here
``CELERY_FAIR_SLOW_FROM``  wall time (epoch seconds) from which the slowdown applies
``CELERY_FAIR_ACKS_LATE``  "1": acknowledge after the task ran (``task_acks_late``)
``CELERY_FAIR_VISIBILITY``  Redis ``visibility_timeout`` (s), restored every second
``CELERY_FAIR_POLL``  Redis ``polling_interval``: the server-side timeout of an idle wait (s)
``CELERY_FAIR_ATOMIC``  "0": Kombu's BRPOP fetch instead of the atomic script
``CELERY_FAIR_METRICS_PORT``  the ``fair_metrics_port`` setting (Prometheus metrics)
``CELERY_FAIR_MASTER_NAME``  Redis Sentinel's master name (a ``sentinel://`` broker)
``CELERY_FAIR_DISABLE_PREFETCH``  "1": ``worker_disable_prefetch`` (Celery >= 5.6)
``CELERY_FAIR_ETA_LIMIT``  ``worker_eta_task_limit`` (Celery >= 5.6)
``CELERY_FAIR_KEYS``  the ``fair_keys`` setting, as ``queue=spec[,queue=spec]``
``CELERY_FAIR_KEY_WEIGHTS``  the ``fair_key_weights`` setting, as ``key=w[,key=w]``
``CELERY_FAIR_KEY_CONCURRENCY``  the ``fair_key_concurrency`` setting, as ``key=n[,key=n]``
``CELERY_FAIR_KEY_RATE``  the ``fair_key_rate_limit`` setting, as ``key=10/s[,key=...]``
``CELERY_FAIR_KEY_LEASE_TTL``  the ``fair_key_lease_ttl`` setting (seconds)
``CELERY_FAIR_CAPACITY``  the ``fair_capacity`` setting, as ``cpu=9,mem=18``
``CELERY_FAIR_QUEUE_CONCURRENCY``  the ``fair_queue_concurrency`` setting, as ``video=3``
``CELERY_FAIR_MAX_PRIORITY``  Celery's ``task_queue_max_priority``
``CELERY_FAIR_PRIORITY``  the ``fair_priority`` setting (``strict`` or ``weighted``)
``CELERY_FAIR_PRIORITY_WEIGHTS``  the ``fair_priority_weights`` setting, as ``0=4,9=1``
``CELERY_FAIR_KEYPREFIX``  Kombu's Redis ``global_keyprefix`` transport option
``CELERY_FAIR_UNKNOWN_MAX_RETURNS``  the ``fair_unknown_task_max_returns`` setting
``CELERY_FAIR_LIVE_WEIGHTS_TTL``  the ``fair_live_weights_ttl`` setting (seconds)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import celery_fair
from tests.harness.ledger import record_entry

app = Celery("celery_fair_workload")
app.conf.update(
    broker_url=os.environ.get("CELERY_FAIR_BROKER", "redis://127.0.0.1:6379/0"),
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
    broker_connection_retry_on_startup=True,
)
if os.environ.get("CELERY_FAIR_BROKER_SSL"):
    app.conf.broker_use_ssl = json.loads(os.environ["CELERY_FAIR_BROKER_SSL"])
if os.environ.get("CELERY_FAIR_COST"):
    app.conf.fair_cost = os.environ["CELERY_FAIR_COST"]
if os.environ.get("CELERY_FAIR_TELEMETRY_DIR"):
    app.conf.fair_telemetry_dir = os.environ["CELERY_FAIR_TELEMETRY_DIR"]
if os.environ.get("CELERY_FAIR_WEIGHTS"):
    app.conf.fair_weights = os.environ["CELERY_FAIR_WEIGHTS"]
if os.environ.get("CELERY_FAIR_LIVE_WEIGHTS_TTL"):
    app.conf.fair_live_weights_ttl = os.environ["CELERY_FAIR_LIVE_WEIGHTS_TTL"]
if os.environ.get("CELERY_FAIR_QUORUM_QUEUES"):
    # Declare these queues as quorum queues (Celery then uses per-consumer QoS).
    from kombu.entity import Queue

    app.conf.task_queues = [
        Queue(name, durable=True, queue_arguments={"x-queue-type": "quorum"})
        for name in os.environ["CELERY_FAIR_QUORUM_QUEUES"].split(",")
    ]
if os.environ.get("CELERY_FAIR_DLX_QUEUES"):
    from kombu.entity import Exchange, Queue

    app.conf.task_queues = [
        Queue(
            name,
            Exchange(name),
            routing_key=name,
            durable=True,
            queue_arguments={"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": name},
        )  # fmt: skip
        for name in os.environ["CELERY_FAIR_DLX_QUEUES"].split(",")
    ]
if os.environ.get("CELERY_FAIR_CODEL"):
    parts = os.environ["CELERY_FAIR_CODEL"].split(",")
    app.conf.fair_codel_target = float(parts[0])
    app.conf.fair_codel_interval = float(parts[1])
    if len(parts) > 2:
        app.conf.fair_codel_action = parts[2]
    if len(parts) > 3:
        app.conf.fair_codel_max_requeues = int(parts[3])
if os.environ.get("CELERY_FAIR_PREFETCH"):
    value = os.environ["CELERY_FAIR_PREFETCH"]
    app.conf.fair_prefetch = value if value == "auto" else int(value)
if os.environ.get("CELERY_FAIR_PREFETCH_MULTIPLIER"):
    app.conf.worker_prefetch_multiplier = int(os.environ["CELERY_FAIR_PREFETCH_MULTIPLIER"])
if os.environ.get("CELERY_FAIR_ACKS_LATE") == "1":
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True
if os.environ.get("CELERY_FAIR_VISIBILITY"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CELERY_FAIR_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if os.environ.get("CELERY_FAIR_POLL"):
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "polling_interval": float(os.environ["CELERY_FAIR_POLL"]),
    }
if os.environ.get("CELERY_FAIR_ATOMIC") == "0":
    app.conf.fair_atomic_fetch = False
if os.environ.get("CELERY_FAIR_METRICS_PORT"):
    app.conf.fair_metrics_port = os.environ["CELERY_FAIR_METRICS_PORT"]
if os.environ.get("CELERY_FAIR_MASTER_NAME"):
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "master_name": os.environ["CELERY_FAIR_MASTER_NAME"],
    }
if os.environ.get("CELERY_FAIR_KEYPREFIX"):
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "global_keyprefix": os.environ["CELERY_FAIR_KEYPREFIX"],
    }
if os.environ.get("CELERY_FAIR_DISABLE_PREFETCH") == "1":
    app.conf.worker_disable_prefetch = True
if os.environ.get("CELERY_FAIR_ETA_LIMIT"):
    app.conf.worker_eta_task_limit = int(os.environ["CELERY_FAIR_ETA_LIMIT"])
if os.environ.get("CELERY_FAIR_KEYS"):
    # "jobs=tenant_id", or "jobs=tenant_id+user_id" for two-level keys.
    app.conf.fair_keys = {
        queue: tuple(spec.split("+")) if "+" in spec else spec
        for queue, spec in (
            part.split("=", 1) for part in os.environ["CELERY_FAIR_KEYS"].split(",") if part
        )
    }
if os.environ.get("CELERY_FAIR_KEY_MAX_BACKLOG"):
    app.conf.fair_key_max_backlog = os.environ["CELERY_FAIR_KEY_MAX_BACKLOG"]
if os.environ.get("CELERY_FAIR_KEY_WEIGHTS"):
    app.conf.fair_key_weights = os.environ["CELERY_FAIR_KEY_WEIGHTS"]
if os.environ.get("CELERY_FAIR_KEY_CONCURRENCY"):
    app.conf.fair_key_concurrency = os.environ["CELERY_FAIR_KEY_CONCURRENCY"]
if os.environ.get("CELERY_FAIR_KEY_RATE"):
    app.conf.fair_key_rate_limit = os.environ["CELERY_FAIR_KEY_RATE"]
if os.environ.get("CELERY_FAIR_KEY_LEASE_TTL"):
    app.conf.fair_key_lease_ttl = float(os.environ["CELERY_FAIR_KEY_LEASE_TTL"])
if os.environ.get("CELERY_FAIR_CAPACITY"):
    app.conf.fair_capacity = os.environ["CELERY_FAIR_CAPACITY"]
if os.environ.get("CELERY_FAIR_QUEUE_CONCURRENCY"):
    app.conf.fair_queue_concurrency = os.environ["CELERY_FAIR_QUEUE_CONCURRENCY"]
if os.environ.get("CELERY_FAIR_MAX_PRIORITY"):
    app.conf.task_queue_max_priority = int(os.environ["CELERY_FAIR_MAX_PRIORITY"])
if os.environ.get("CELERY_FAIR_PRIORITY"):
    app.conf.fair_priority = os.environ["CELERY_FAIR_PRIORITY"]
if os.environ.get("CELERY_FAIR_PRIORITY_WEIGHTS"):
    app.conf.fair_priority_weights = os.environ["CELERY_FAIR_PRIORITY_WEIGHTS"]
if os.environ.get("CELERY_FAIR_UNKNOWN_MAX_RETURNS"):
    app.conf.fair_unknown_task_max_returns = int(os.environ["CELERY_FAIR_UNKNOWN_MAX_RETURNS"])
if os.environ.get("CELERY_FAIR", "1") == "1":
    celery_fair.install(app)


@app.task(name="work")
def work(us: int = 0) -> None:
    """Busy for ``us`` microseconds of CPU (0: a no-op task)."""
    if us:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass


@app.task(name="nap")
def nap(ms: float = 0.0) -> None:
    """Sleep ``ms`` milliseconds: occupies a pool slot without using a core."""
    if ms:
        time.sleep(ms / 1000.0)


@app.task(name="fail")
def fail(message: str = "failed on purpose") -> None:
    """Raise ``ValueError`` (a task failure)."""
    raise ValueError(message)


@app.task(name="retry_once", bind=True, max_retries=1, default_retry_delay=0)
def retry_once(self: Any) -> str:
    """Ask for one retry, then succeed on the second run."""
    if not self.request.retries:
        raise self.retry(countdown=0)
    return "done"


@app.task(name="ledger", bind=True)
def ledger(
    self: object, ms: float = 0.0, tenant_id: str | None = None, user_id: str | None = None
) -> None:
    """Sleep ``ms`` (plus this worker's slowdown) and record the run in a Redis list.

    The entry names the task, the worker, the queue it came from, its tenant
    (``tenant_id``, the key the showcase routes by; ``user_id``, a user within
    it for two-level keys), when it was published and
    when it started and finished, and whether the message was redelivered
    (restored from Kombu's unacked index).  A per-tenant counter in the hash
    ``ledger:tenants`` lets a driver follow progress without reading the list.
    """
    _record_run(self.request, ms, tenant_id, user_id)  # type: ignore[attr-defined]


@app.task(
    name="held", bind=True, fair_resources=os.environ.get("CELERY_FAIR_HELD_RESOURCES") or None
)
def held(self: object, ms: float = 0.0, tenant_id: str | None = None) -> None:
    """``ledger`` with a ``fair_resources`` attribute (``CELERY_FAIR_HELD_RESOURCES``)."""
    _record_run(self.request, ms, tenant_id, None)  # type: ignore[attr-defined]


def _record_run(request: Any, ms: float, tenant_id: str | None, user_id: str | None) -> None:
    """The ``ledger`` task's run: sleep, then record it."""

    started = time.time()
    url = os.environ.get("CELERY_FAIR_LEDGER")
    delivery = getattr(request, "delivery_info", None) or {}
    redelivered = bool(delivery.get("redelivered"))
    if url and os.environ.get("CELERY_FAIR_LEDGER_STARTS") == "1":
        # Before the run: a start with no entry in ``ledger`` is a run killed midway.
        start = {"id": request.id, "started": started, "redelivered": redelivered}
        record_entry(url, "ledger:started", start)
    slow = float(os.environ.get("CELERY_FAIR_SLOW_MS", "0") or 0)
    if started < float(os.environ.get("CELERY_FAIR_SLOW_FROM", "0") or 0):
        slow = 0.0
    if ms or slow:
        time.sleep((ms + slow) / 1000.0)
    if url:
        entry = {
            "id": request.id,
            "worker": request.hostname,
            "requeues": int(getattr(request, "fair_codel_requeues", 0) or 0),
            "started": started,
            "finished": time.time(),
            "published": getattr(request, "fair_published", None),
            "tenant": tenant_id,
            "user": user_id,
            "queue": delivery.get("routing_key"),
            "redelivered": redelivered,
            "resources": getattr(request, "fair_resources", None),
        }
        record_entry(url, "ledger", entry, count=("ledger:tenants", tenant_id or ""))
