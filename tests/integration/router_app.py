"""Celery app of the router integration tests; the broker URL comes from the environment."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_fair.routing import ConsistentHashRouter

BROKER_ENV = "CELERY_FAIR_ROUTER_BROKER"
QUEUES = {"t0": 10, "t1": 10, "t2": 20}

router = ConsistentHashRouter(QUEUES, key="tenant_id", tasks="router_app.*")

_url = os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/0")
app = Celery("router_app", broker=_url, backend=_url, set_as_current=False)
app.conf.task_routes = (router,)
app.conf.result_expires = 3600
app.conf.worker_hijack_root_logger = False


@app.task(name="router_app.where", bind=True, shared=False)
def where(self: Any, seq: int, tenant_id: str | None = None) -> dict[str, Any]:
    """Report the queue this task was delivered from and the key header it carried."""
    delivery = self.request.delivery_info or {}
    return {
        "seq": seq,
        "tenant_id": tenant_id,
        "queue": delivery.get("routing_key"),
        "fair_key": getattr(self.request, "fair_key", None),
        "hostname": self.request.hostname,
    }
