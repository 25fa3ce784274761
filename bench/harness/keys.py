"""Helpers for tests and benchmarks of keyed queues: publish by key, read concurrency."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ("fetchable_payload", "keyed_app", "most_at_once", "publish_by_key")


def keyed_app(
    broker_url: str, fair_keys: Mapping[str, Any], name: str = "keyed-producer", **conf: Any
) -> Any:
    """A producer app with celery-fair, these ``fair_keys`` and other settings ``conf``
    (the user's surface)."""
    from celery import Celery

    import celery_fair

    app = Celery(name, broker=broker_url, set_as_current=False)
    app.conf.fair_keys = dict(fair_keys)
    app.conf.update(conf)
    celery_fair.install(app)
    return app


def publish_by_key(
    app: Any, queue: str, counts: Mapping[str, int], ms: float, priority: int | None = None
) -> None:
    """Publish ``counts[key]`` ``ledger(ms, tenant_id=key)`` tasks, the keys interleaved.

    Interleaved, so that publish order favours no key.  ``priority``: Celery's
    ``priority`` argument of every task (on Redis, 0 is served first).
    """
    left = dict(counts)
    with app.producer_or_acquire() as producer:
        while any(left.values()):
            for key in counts:
                if left[key]:
                    left[key] -= 1
                    app.send_task(
                        "ledger", kwargs={"ms": ms, "tenant_id": key}, queue=queue,
                        producer=producer, priority=priority,
                    )  # fmt: skip


def most_at_once(entries: Iterable[Any]) -> dict[str, int]:
    """Per tenant, the most ledger entries that overlapped in time (a sweep over start/finish)."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in entries:
        events[e.tenant or ""] += [(e.started, 1), (e.finished, -1)]
    most: dict[str, int] = {}
    for key, points in events.items():
        running = peak = 0
        for _, step in sorted(points):  # at a tie, a finish (-1) sorts before a start
            running += step
            peak = max(peak, running)
        most[key] = peak
    return most


def restore_unacked(app: Any, client: Any, visibility: float, timeout: float = 30.0) -> int:
    """Restore every unacknowledged message, as any Redis consumer does once the
    visibility timeout passed; returns how many there were.

    ``app`` is a producer app with celery-fair installed (keyed messages go back
    to their keys' lists in their levels); ``client`` a redis-py client of the
    same Redis; ``visibility`` the seconds the messages must have waited.
    """
    import time

    held = int(client.hlen("unacked"))
    app.conf.broker_transport_options = {"visibility_timeout": visibility}
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        deadline = time.monotonic() + timeout
        while client.hlen("unacked"):
            assert time.monotonic() < deadline, "the unacked messages were not restored"
            channel.qos.restore_visible(num=500)
            time.sleep(0.2)  # polled with a deadline: waits for the visibility timeout
    return held


def fetchable_payload(key: str, queue: str) -> str:
    """The smallest Kombu Redis payload the fetch script serves (a delivery tag, a key):
    for measuring the scripts alone, never for a worker."""
    return json.dumps(
        {
            "body": "",
            "headers": {"fair_key": key},
            "properties": {
                "delivery_tag": str(uuid.uuid4()),
                "delivery_info": {"exchange": queue, "routing_key": queue},
            },
        }
    )
