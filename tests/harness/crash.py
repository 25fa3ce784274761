"""Crash runs of scheduled tasks (``fair_eta = "broker"``): publish, inspect, classify.

Shared by ``bench.redis_crash_loss`` (its scheduled modes) and
``tests/integration/test_scheduled_crash.py``.  The ledger task
(:mod:`tests.harness.workload`, with ``CELERY_FAIR_LEDGER_STARTS=1``) records
each start in ``ledger:started`` and each finished run in ``ledger``, each
with whether its message was redelivered (restored from Kombu's unacked index).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from celery_fair.keys import store
from celery_fair.keys.layout import KeyedNames

__all__ = (
    "DUPLICATE_CLASSES", "classify_duplicates", "leftovers", "schedule_tasks", "scheduled_count",
)  # fmt: skip

#: Distinct values of ``tenant_id`` (the key of a keyed queue).
KEYS_PER_QUEUE = 50


def schedule_tasks(
    url: str,
    queues: Sequence[str],
    per_queue: int,
    keyed: bool,
    first_due: float,
    spread: float,
    keys: int = KEYS_PER_QUEUE,
) -> set[str]:
    """Send ``per_queue`` ledger tasks to each queue with an eta, from an app with
    ``fair_eta = "broker"``: due evenly from ``first_due`` over ``spread`` seconds,
    the queues alternating, ``tenant_id`` one of ``keys`` in turn (``keyed``: each
    queue keyed by it).  Returns the task ids."""
    from datetime import datetime, timezone

    from celery import Celery

    import celery_fair

    app = Celery("crash-producer", broker=url, set_as_current=False)
    app.conf.update(fair_eta="broker", task_ignore_result=True)
    if keyed:
        app.conf.fair_keys = dict.fromkeys(queues, "tenant_id")
    celery_fair.install(app)
    total = per_queue * len(queues)
    ids: set[str] = set()
    with app.producer_or_acquire() as producer:
        for i in range(total):
            due = first_due + spread * i / max(total - 1, 1)
            result = app.send_task(
                "ledger", args=(1,), queue=queues[i % len(queues)], producer=producer,
                kwargs={"tenant_id": f"k{(i // len(queues)) % keys}"},
                eta=datetime.fromtimestamp(due, tz=timezone.utc),
            )  # fmt: skip
            ids.add(result.id)
    app.close()
    return ids


def scheduled_count(client: Any, queues: Sequence[str]) -> int:
    """Messages waiting in the queues' schedules."""
    return sum(store.scheduled(client, KeyedNames(q)) for q in queues)


def leftovers(client: Any, queues: Sequence[str]) -> dict[str, int]:
    """What is left on the broker: scheduled, waiting (lists and keys), unacknowledged."""
    names = [KeyedNames(q) for q in queues]
    return {
        "scheduled": scheduled_count(client, queues),
        "queued": sum(int(client.llen(q)) for q in queues)
        + sum(store.waiting_keyed(client, names)),
        "unacked": int(client.hlen("unacked")),
        "unacked_index": int(client.zcard("unacked_index")),
    }


def classify_duplicates(
    ids: set[str], starts: list[dict[str, Any]], ends: list[dict[str, Any]]
) -> tuple[Counter[str], list[dict[str, Any]]]:
    """Each extra run of a task, by what explains it (the classes of :data:`DUPLICATE_CLASSES`).

    A run is a ``ledger:started`` record; it finished if ``ledger`` has an entry
    with its id and start time.  Returns the extra runs per class and the
    duplicated tasks' runs.
    """
    finished = {(e["id"], e["started"]): e["finished"] for e in ends}
    runs: dict[str, list[dict[str, Any]]] = {}
    for start in starts:
        if start["id"] in ids:
            runs.setdefault(start["id"], []).append(start)
    classes: Counter[str] = Counter(dict.fromkeys(DUPLICATE_CLASSES, 0))
    details = []
    for tid, each in runs.items():
        if len(each) < 2:
            continue
        each.sort(key=lambda r: r["started"])
        if sum(1 for r in each if not r["redelivered"]) > 1:
            kind = "delivered twice"
        elif (tid, each[0]["started"]) not in finished:
            kind = "first run killed midway"
        else:
            kind = "first run finished, redelivered"
        classes[kind] += len(each) - 1
        details.append(
            {
                "id": tid,
                "class": kind,
                "runs": [{**r, "finished": finished.get((tid, r["started"]))} for r in each],
            }
        )
    return classes, details


#: Why a task ran more than once: its first run was killed before it finished
#: (late acks: the message is restored); it finished but its message was
#: restored and delivered again (its ack lost to a crash, or Kombu's restore of a
#: closing channel's unacked messages); or it was delivered twice without any
#: restore (two copies of one message: a defect, e.g. promoted twice).
DUPLICATE_CLASSES = (
    "first run killed midway",
    "first run finished, redelivered",
    "delivered twice",
)
