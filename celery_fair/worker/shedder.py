"""CoDel in the worker: prefetched tasks that waited too long go back.

Each task about to leave the wait buffer for a pool slot is shown to a
:class:`~celery_fair.scheduling.codel.CoDelController` with its sojourn (time
since the worker received it, or since it came due for an ETA task).  When
CoDel says drop (RFC 8289: the *minimum* sojourn stayed above ``target`` for
an ``interval``), the task is returned to the broker, where an idle worker
can take it, and the next waiting task is considered at once.

A return (:func:`celery_fair.kombu.requeue.requeue`) puts a copy back with
the ``fair_codel_requeues`` header incremented, then acknowledges the
original (basic.reject with requeue cannot carry a count, and a count is
what stops a task from bouncing between slow workers forever).  A crash
between the two steps leaves a duplicate, never a loss.  On Redis the copy
goes to the *front* of its queue (it keeps its place in line: the next fetch
by any worker takes it); on RabbitMQ it is published to the same exchange
and routing key and joins the back of the queue.
After ``fair_codel_max_requeues`` returns a task runs here.  ``reject``
rejects without requeue: RabbitMQ dead-letters it when the queue has a
dead-letter exchange (checked at start: other brokers would drop it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import compat
from ..kombu.requeue import requeue, requeue_count
from ..scheduling.dispatch import SendBack
from ..scheduling.shedding import (
    UNKNOWN_QUEUE,
    CoDelOptions,
    SheddingPolicy,
    SheddingStatistics,
)

__all__ = ("RECEIVED_MONOTONIC", "Shedder", "ShedderStatistics")

logger = logging.getLogger(__name__)

#: Monotonic receipt (or due) time stamped on the request by the tracker.
RECEIVED_MONOTONIC = "_fair_received_monotonic"

#: ``inspect fair_stats`` -> ``codel``: the shared policy's record.
ShedderStatistics = SheddingStatistics


class Shedder:
    """Carries out the shared :class:`SheddingPolicy` on Celery requests."""

    def __init__(
        self,
        options: CoDelOptions,
        *,
        clock: Callable[[], float],
        on_returned: Callable[[Any, str], None] | None = None,
        queue_of: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.policy = SheddingPolicy(options, clock=clock)
        self.on_returned = on_returned
        self.queue_of = queue_of

    @property
    def requeued_by_queue(self) -> dict[str, int]:
        return self.policy.returned["requeue"]

    @property
    def rejected_by_queue(self) -> dict[str, int]:
        return self.policy.returned["reject"]

    def check(self, request: Any, backlog: int) -> SendBack | None:
        """The admission loop's CoDel check: None runs ``request`` now."""
        received = getattr(request, RECEIVED_MONOTONIC, None)
        if received is None:
            return None
        known = self.queue_of(request) if self.queue_of is not None else None
        # Without a known queue: to the exchange and routing key it came with.
        return self.policy.check(
            known or UNKNOWN_QUEUE, received, backlog, lambda: _requeues(request), destination=known
        )

    def send_back(self, request: Any, back: SendBack) -> bool:
        """Carry out :meth:`check`'s verdict: True if ``request`` left, False to run it here."""
        if not requeue(
            request.message, back, log=logger,
            failure="celery-fair: could not return %s to the broker", args=(request.id,),
            ack=request.acknowledge, reject=request.reject,
        ):  # fmt: skip
            self.policy.failed(back.queue or UNKNOWN_QUEUE, back)
            return False  # running the task beats losing it
        from celery.worker.state import task_ready

        task_ready(request)
        if self.on_returned is not None:
            self.on_returned(request, back.reason)
        return True

    def empty(self) -> None:
        """The wait buffer is empty (CoDel leaves its dropping state)."""
        self.policy.empty()

    def statistics(self) -> ShedderStatistics:
        """A frozen snapshot: the CoDel state and what was returned, per queue."""
        return self.policy.statistics()


def _requeues(request: Any) -> int:
    return requeue_count(compat.request_headers(request))
