"""A multi-tenant Celery project with celery-fair: routing, weights, CoDel.

Tenants are routed by ``tenant_id`` onto 4 standard shard queues and one
premium queue (a stable mapping: a tenant always lands on the same queue);
the worker shares itself 4:1 between premium and each standard shard, by
measured run time, and sends prefetched tasks that waited too long back to
the broker for an idle worker.

    celery -A proj worker -P prefork -c 2 -Q premium,std.0,std.1,std.2,std.3
    python publish.py --tasks 400
    celery -A proj inspect fair_stats
    celery -A proj control fair_weights premium=8    # for an hour; add keep to make it last

``BROKER_URL`` chooses the broker (default: a local Redis).
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_fair

STANDARD = [f"std.{i}" for i in range(4)]
PREMIUM_TENANTS = {"acme", "globex"}

app = Celery("proj", broker=os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0"))


def route_premium(
    name: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    options: dict[str, object],
    task: object = None,
    **kw: object,
) -> dict[str, str] | None:
    """Premium tenants get their own queue; everyone else is hashed onto a shard."""
    if kwargs.get("tenant_id") in PREMIUM_TENANTS:
        return {"queue": "premium"}
    return None


app.conf.update(
    task_ignore_result=True,
    task_acks_late=True,  # a task lost with its worker is redelivered
    task_routes=(
        route_premium,
        celery_fair.ConsistentHashRouter(STANDARD, key="tenant_id", tasks=["proj.*"]),
    ),
    # celery-fair: weights are quanta; premium gets 4x any one standard shard.
    fair_weights={"premium": 4, **dict.fromkeys(STANDARD, 1)},
    fair_cost="runtime",  # share run time, not task counts
    fair_codel_target=0.1,  # a prefetched task may wait 100 ms for a slot...
    fair_codel_interval=1.0,  # ...measured over about the longest normal task
)
celery_fair.install(app)


@app.task(name="proj.process")
def process(tenant_id: str, item: int, ms: float = 5.0) -> str:
    """Pretend to work on one item for ``ms`` milliseconds."""
    time.sleep(ms / 1000.0)
    return f"{tenant_id}:{item}"
