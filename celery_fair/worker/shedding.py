"""CoDel in the worker: prefetched tasks that waited too long go back.

Each task about to leave the wait buffer for a pool slot is shown to a
:class:`~celery_fair.scheduling.codel.CoDelController` with its sojourn (time
since the worker received it, or since it came due for an ETA task).  When
CoDel says drop (RFC 8289: the *minimum* sojourn stayed above ``target`` for
an ``interval``), the task is returned to the broker, where an idle worker
can take it, and the next waiting task is considered at once.

``requeue`` puts a copy back with the ``fair_codel_requeues`` header
incremented, then acknowledges the original (basic.reject with requeue cannot
carry a count, and a count is what stops a task from bouncing between slow
workers forever).  A crash between the two steps leaves a duplicate, never a
loss.  On Redis the copy goes to the *front* of its queue (it keeps its place
in line: the next fetch by any worker takes it); on RabbitMQ it is published
to the same exchange and routing key and joins the back of the queue.
After ``fair_codel_max_requeues`` returns a task runs here.  ``reject``
rejects without requeue: RabbitMQ dead-letters it when the queue has a
dead-letter exchange (checked at start: other brokers would drop it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .. import compat
from ..kombu.requeue import REQUEUE_HEADER, requeue_count, return_copy
from ..scheduling.codel import CoDelController, CoDelStatistics

__all__ = ("REQUEUE_HEADER", "RECEIVED_MONOTONIC", "Shedder", "ShedderStatistics")

logger = logging.getLogger(__name__)

#: Monotonic receipt (or due) time stamped on the request by the tracker.
RECEIVED_MONOTONIC = "_fair_received_monotonic"


class Shedder:
    """Decides, per task leaving the wait buffer, whether to send it back."""

    def __init__(
        self,
        app: Any,
        *,
        target: float,
        interval: float,
        action: str = "requeue",
        max_requeues: int = 3,
        clock: Callable[[], float],
        on_returned: Callable[[Any, str], None] | None = None,
        queue_of: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.app = app
        self.clock = clock
        self.controller = CoDelController(target, interval, clock=clock)
        self.action = action
        self.max_requeues = max_requeues
        self.on_returned = on_returned
        self.queue_of = queue_of
        self.requeued = 0
        self.rejected = 0
        self.kept = 0  # stale, but at the requeue cap: ran here
        self.errors = 0
        #: Tasks returned per queue (only shedding touches these: off the hot path).
        self.requeued_by_queue: dict[str, int] = {}
        self.rejected_by_queue: dict[str, int] = {}

    def admit(self, request: Any, backlog: int) -> bool:
        """True: dispatch ``request`` now.  False: it went back to the broker."""
        received = getattr(request, RECEIVED_MONOTONIC, None)
        if received is None:
            return True
        now = self.clock()
        if not self.controller.should_drop(now - received, now, backlog=backlog):
            return True
        count = _requeues(request)
        if self.action == "requeue" and count >= self.max_requeues:
            self.kept += 1
            return True
        try:
            if self.action == "requeue":
                self._requeue(request, count)
                self.requeued += 1
                self._count(self.requeued_by_queue, request)
                outcome = "codel-requeue"
            else:
                request.reject(requeue=False)
                self.rejected += 1
                self._count(self.rejected_by_queue, request)
                outcome = "codel-reject"
        except Exception:  # noqa: BLE001 - running the task beats losing it
            self.errors += 1
            logger.warning(
                "celery-fair: could not return %s to the broker", request.id, exc_info=True
            )
            return True
        from celery.worker.state import task_ready

        task_ready(request)
        if self.on_returned is not None:
            self.on_returned(request, outcome)
        return False

    def _count(self, counts: dict[str, int], request: Any) -> None:
        queue = (self.queue_of(request) if self.queue_of is not None else None) or "<unknown>"
        counts[queue] = counts.get(queue, 0) + 1

    def empty(self) -> None:
        """The wait buffer is empty (CoDel leaves its dropping state)."""
        self.controller.empty(self.clock())

    def _requeue(self, request: Any, count: int) -> None:
        queue = self.queue_of(request) if self.queue_of is not None else None
        return_copy(request.message, queue, {REQUEUE_HEADER: count + 1}, front=True)
        request.acknowledge()

    def statistics(self) -> ShedderStatistics:
        """A frozen snapshot: the CoDel state and what was returned, per queue."""
        return ShedderStatistics(
            controller=self.controller.statistics(),
            action=self.action,
            max_requeues=self.max_requeues,
            requeued=self.requeued,
            rejected=self.rejected,
            requeued_by_queue=dict(self.requeued_by_queue),
            rejected_by_queue=dict(self.rejected_by_queue),
            kept_at_cap=self.kept,
            errors=self.errors,
        )


@dataclass(frozen=True)
class ShedderStatistics:
    """A snapshot of a :class:`Shedder` (``inspect fair_stats`` -> ``codel``)."""

    controller: CoDelStatistics
    action: str
    max_requeues: int
    requeued: int
    rejected: int
    requeued_by_queue: Mapping[str, int]
    rejected_by_queue: Mapping[str, int]
    kept_at_cap: int
    errors: int

    @property
    def dropping(self) -> bool:
        """Whether CoDel finds the buffer stale now."""
        return self.controller.dropping

    def as_dict(self) -> dict[str, Any]:
        """The CoDel state and these counters, flat, as JSON-friendly data."""
        stats: dict[str, Any] = dict(self.controller.as_dict())
        for name in (f.name for f in fields(self) if f.name != "controller"):
            value = getattr(self, name)
            stats[name] = dict(value) if isinstance(value, Mapping) else value
        return stats


def _requeues(request: Any) -> int:
    return requeue_count(compat.request_headers(request))
