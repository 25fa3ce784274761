"""Which consumed queue a task's request came from, and a keyed queue's key.

Mapped again at every (re)connection from the task consumer's queues; read
by the dispatch order, the task tracker, the shedder and the quarantine.
On RabbitMQ a keyed queue's lanes (:mod:`celery_fair.keys.lanes`) map to
the keyed queue: everything above the consumer sees the one queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import compat
from ..keys.lanes import KeyLanes, declared_with_priority, priority_rank
from ..keys.layout import level_rank
from ..wire import KEY_HEADER, USER_HEADER
from ..wire.served import NOT_SERVED, Served
from .attachment import Attachment

__all__ = ("QueueMap",)


class QueueMap:
    """The consumed queues by routing key; the keyed queues are the attachment's."""

    def __init__(self, attachment: Attachment) -> None:
        self.attachment = attachment
        self._by_key: dict[str, str] = {}
        #: Keyed queues on RabbitMQ: their lanes (None: no lanes).
        self.lanes: KeyLanes | None = None
        #: Lane -> its keyed queue (each keyed queue -> itself).
        self.parents: dict[str, str] = {}
        #: The consumed queues declared with a maximum priority (RabbitMQ's own).
        self._prioritised: frozenset[str] = frozenset()
        #: RabbitMQ, ``fair_priority="weighted"``: a keyed task's rank is its level
        #: (:func:`~celery_fair.keys.lanes.priority_rank`), whose weight the buffer has.
        self.weighted_levels = False

    def use_lanes(self, lanes: KeyLanes) -> None:
        """Keyed queues on RabbitMQ: a lane's requests are its keyed queue's."""
        self.lanes = lanes
        self.parents = lanes.parents()

    def logical(self, name: str) -> str:
        """The queue a consumed queue is part of: a lane's keyed queue, else itself."""
        return self.parents.get(name, name)

    def map(self, queues: Iterable[Any]) -> None:
        """The consumer's queues now (Kombu ``Queue`` objects)."""
        by_key: dict[str, str] = {}
        prioritised: set[str] = set()
        for queue in queues:
            logical = self.logical(queue.name)
            by_key.setdefault(queue.routing_key or queue.name, logical)
            by_key.setdefault(queue.name, logical)
            if declared_with_priority(queue):
                prioritised.add(logical)
        self._by_key = by_key
        self._prioritised = frozenset(prioritised)

    def queue_of(self, request: Any) -> str | None:
        """The consumed queue a request came from (by its routing key)."""
        info = getattr(request, "delivery_info", None) or {}
        key = info.get("routing_key")
        return self._by_key.get(key) if key is not None else None

    def _rank(self, request: Any, queue: str) -> int:
        """RabbitMQ: a task's level in the buffer, from its priority when ``queue`` was
        declared with a maximum priority, negated (the highest first, as RabbitMQ
        delivers within each lane): the priority itself, or its level's step when
        the levels are weighted (:attr:`weighted_levels`); else the one level 0."""
        if queue not in self._prioritised:
            return 0
        priority = (getattr(request, "delivery_info", None) or {}).get("priority")
        if self.weighted_levels:
            return priority_rank(priority)
        return -priority if isinstance(priority, int) else 0

    def key_of(self, request: Any, queue: str) -> tuple[str | None, int, str | None]:
        """A keyed queue's request: the key it was served as, its level's rank and
        its user within the key (two-level keys; else None).

        The rank is Kombu's priority step of the level (0, the first, for
        anything else): the worker's buffer takes the lowest first.  On
        RabbitMQ it is the negated priority, for a queue declared with a
        maximum priority.  Not keyed: ``(None, 0, None)``.
        """
        if request is None:
            return None, 0, None
        lanes = self.lanes
        if lanes is not None and queue in lanes.keyed:
            # RabbitMQ: the key the producer stamped; none (a plain producer's
            # task, in the queue itself) is the unkeyed key.
            headers = compat.request_headers(request)
            key, user = headers.get(KEY_HEADER), headers.get(USER_HEADER)
            user = user if isinstance(user, str) else None
            return (key if isinstance(key, str) else ""), self._rank(request, queue), user
        keyed = self.attachment.keyed
        if keyed is None or queue not in keyed.queues:
            return None, 0, None
        served = Served.from_headers(compat.request_headers(request)) or NOT_SERVED
        return served.key, level_rank(served.level), served.user or None
