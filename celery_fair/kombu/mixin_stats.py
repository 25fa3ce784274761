"""The statistics records of :class:`~celery_fair.kombu.mixin.FairConsumerMixin`.

Plain frozen records, so that a snapshot can be kept, compared or sent as
JSON (:meth:`FairConsumerStatistics.as_dict`) without holding the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..scheduling.codel import CoDelStatistics
from ..scheduling.drr import DRRStatistics

__all__ = ("FairConsumerStatistics", "FairQueueStatistics")


@dataclass(frozen=True)
class FairQueueStatistics:
    """One queue of a :class:`FairConsumerMixin`, as a plain record."""

    name: str
    weight: float
    window: int
    buffered: int
    acked: int
    failed: int
    served_count: int
    served_cost: float
    deficit: float
    active: bool
    #: CoDel: stale messages sent back to the broker, rejected, and handled
    #: here because they had been sent back ``codel_max_requeues`` times.
    codel_requeued: int = 0
    codel_rejected: int = 0
    codel_kept: int = 0


@dataclass(frozen=True)
class FairConsumerStatistics:
    """A snapshot of a :class:`FairConsumerMixin`."""

    cost: str
    queues: tuple[FairQueueStatistics, ...]
    buffered: int
    handled: int
    idle_waits: int
    drr: DRRStatistics
    #: The CoDel controller's state and counters (None: CoDel is off).
    codel: CoDelStatistics | None = None

    def queue(self, name: str) -> FairQueueStatistics:
        """The record of queue ``name``."""
        for record in self.queues:
            if record.name == name:
                return record
        raise KeyError(f"unknown queue {name!r}")

    def as_dict(self) -> dict[str, object]:
        """Return the record as JSON-friendly nested dicts."""
        return {
            "cost": self.cost,
            "buffered": self.buffered,
            "handled": self.handled,
            "idle_waits": self.idle_waits,
            "queues": {
                q.name: {
                    "weight": q.weight,
                    "window": q.window,
                    "buffered": q.buffered,
                    "acked": q.acked,
                    "failed": q.failed,
                    "served_count": q.served_count,
                    "served_cost": q.served_cost,
                    "deficit": q.deficit,
                    "active": q.active,
                    "codel_requeued": q.codel_requeued,
                    "codel_rejected": q.codel_rejected,
                    "codel_kept": q.codel_kept,
                }
                for q in self.queues
            },
            "drr": self.drr.as_dict(),
            "codel": None if self.codel is None else self.codel.as_dict(),
        }
