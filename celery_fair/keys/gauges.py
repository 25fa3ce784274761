"""The Prometheus families of what the broker holds for keyed queues, built in one place.

The worker's ``/metrics`` and the exporter both serve them, under the same
names; a figure read from the broker is the same for every worker, so it is
not summed over workers (``max by (queue, limit)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ("PREFIX", "keys_throttled")

#: The prefix of every celery-fair metric.
PREFIX = "celery_fair"


class Counts(Protocol):
    """Keys throttled now (a :class:`~celery_fair.keys.throttling.Throttled` or a
    :class:`~celery_fair.keys.throttling.KeyedLimitsState`)."""

    @property
    def at_limit(self) -> int: ...

    @property
    def sleeping(self) -> int: ...


def keys_throttled(by_queue: Mapping[str, Counts], worker: str | None = None) -> Any:
    """``celery_fair_keys_throttled{queue, limit}``: keys throttled now, by limit.

    ``worker``: the worker's name, a label on the worker's endpoint.
    """
    from prometheus_client.core import GaugeMetricFamily

    labels = ["queue", "limit"] if worker is None else ["worker", "queue", "limit"]
    family = GaugeMetricFamily(
        f"{PREFIX}_keys_throttled",
        "Keys of a keyed queue throttled now (set aside by their limits), by limit "
        "(concurrency or rate); read from the broker, the same for every worker.",
        labels=labels,
    )
    first = [] if worker is None else [worker]
    for queue, throttled in sorted(by_queue.items()):
        family.add_metric([*first, queue, "concurrency"], float(throttled.at_limit))
        family.add_metric([*first, queue, "rate"], float(throttled.sleeping))
    return family
