"""The key slots a worker holds (per-key limits), and how many more it may fetch.

A task of a limited key holds its key's slot from its fetch until it
finishes: :class:`Leases` follows each task from dispatch to finish, counts
the tasks of each keyed queue that hold a slot here, and hands the releases
to the worker's :class:`~celery_fair.keys.releases.ReleaseOutbox`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..scheduling.estimate import Ewma
from .limits import KeyLimits
from .releases import ReleaseOutbox

__all__ = ("LOOKAHEAD_BELOW", "Leases")

_RUNNING, _FINISHED, _SETTLED = "running", "finished", "settled"
_UNKNOWN: tuple[str | None, str | None] = (None, None)

#: Seconds. While a limited queue's tasks take less than this on average, a
#: worker fetches one task beyond its pool slots. Without it a pool slot waits,
#: after every task, for the release and the fetch of the next one: 13-18% of
#: the throughput with 10 ms tasks, 37-41% with no-op tasks (bench.key_limits).
#: The task fetched ahead holds its key's slot while it waits, at most about
#: one task length: below this, that wait is short; above it, the round trip
#: is a small part of a task and the slot is better left to other workers.
LOOKAHEAD_BELOW = 0.1


class Leases:
    """The key slots held by one worker's tasks of its keyed ``queues``.

    ``slots`` is the worker's pool size: limited tasks fetched and not
    finished stay below it, plus one while the queue's tasks are short
    (:data:`LOOKAHEAD_BELOW`).  Without ``limits`` nothing holds a slot.
    """

    def __init__(
        self,
        queues: Iterable[str],
        outbox: ReleaseOutbox,
        *,
        limits: KeyLimits | None = None,
        slots: int = 1,
    ) -> None:
        self.queues = frozenset(queues)
        self.outbox = outbox
        self.limits = limits if limits is not None else KeyLimits()
        self.slots = max(1, slots)
        self._lock = threading.Lock()
        #: Delivery tag -> (what happened first, its queue), from dispatch to finish.
        self._tags: dict[Any, tuple[str, str | None]] = {}
        self._in_flight: dict[str, int] = {}
        self._runtimes: dict[str, Ewma] = {}

    @property
    def limited(self) -> bool:
        """Whether the keyed queues have per-key limits (tasks hold leases)."""
        return bool(self.limits)

    def adopt(self, queues: Iterable[str]) -> None:
        """Hold slots for these queues too (a keyed backlog ``fair_keys`` does not name)."""
        self.queues = self.queues | frozenset(queues)

    # A task holds its key's slot from its fetch until it finishes.  Two events
    # end it: the task's completion (it ran) and its message's ack or reject.
    # With early acks the ack comes when the pool accepts the task, before it
    # runs; a task revoked, expired or rejected before it runs is only acked.
    # So: the slot is freed at completion, or at an ack of a task never
    # dispatched; ``_tags`` remembers which of the two happened first.

    def fetched(self, queue: str) -> None:
        """The fetch served a message of keyed ``queue``: it holds a slot."""
        if self.limited:
            with self._lock:
                self._in_flight[queue] = self._in_flight.get(queue, 0) + 1

    def dispatched(self, queue: str | None, delivery_tag: Any) -> None:
        """A task of ``queue`` (a limited key's) was handed to the pool."""
        if self.limited and delivery_tag:
            with self._lock:
                self._tags[delivery_tag] = (_RUNNING, queue)

    def finished(self, queue: str | None, delivery_tag: Any, runtime: float | None = None) -> None:
        """A dispatched task finished after ``runtime`` s (or its pool process died)."""
        if not self.limited or not delivery_tag:
            return
        with self._lock:
            if runtime is not None and queue in self.queues:
                self._runtimes.setdefault(queue, Ewma()).update(max(0.0, runtime))
            state, _ = self._tags.pop(delivery_tag, _UNKNOWN)
            if state == _RUNNING:
                self._tags[delivery_tag] = (_FINISHED, queue)  # its ack is still to come
        self._release(queue, delivery_tag)

    def settled(self, queue: str | None, delivery_tag: Any) -> None:
        """The message was acked or rejected: free the slot of a task that never ran."""
        if not self.limited or not delivery_tag:
            return
        with self._lock:
            state, _ = self._tags.pop(delivery_tag, _UNKNOWN)
            if state == _RUNNING:
                self._tags[delivery_tag] = (_SETTLED, queue)  # it runs: freed when it finishes
                return
        if state is None:
            self._release(queue, delivery_tag)

    def _release(self, queue: str | None, delivery_tag: Any) -> None:
        if queue is None or queue not in self.queues:
            return
        with self._lock:
            held = self._in_flight.get(queue, 0)
            self._in_flight[queue] = max(0, held - 1)
        # A worker that was full may fetch from the queue again: its idle fetch
        # must end, in the release's round trip when the release goes alone.
        # "Full" counts from the pool's size, not the capacity: the capacity can
        # change between a fetch and its release, and a wake-up too many costs
        # an empty fetch, one too few a poll interval.
        self.outbox.release(queue, str(delivery_tag), wake=held >= self.slots)

    def has_room(self, queue: str) -> bool:
        """Whether this worker may fetch from keyed ``queue`` now.

        With per-key limits a fetched task holds its key's slot until it
        finishes, so a worker fetches for its free pool slots (and one task
        ahead while tasks are short, see :meth:`capacity`): tasks that would
        wait in its buffer would keep their keys' slots from workers with
        free pool slots.
        """
        room = self.room(queue)
        return room is None or room > 0

    def room(self, queue: str) -> int | None:
        """How many more tasks of keyed ``queue`` this worker may fetch (None: no bound)."""
        if not self.limited:
            return None
        return max(0, self.capacity(queue) - self._in_flight.get(queue, 0))

    def capacity(self, queue: str) -> int:
        """Tasks of limited ``queue`` this worker holds at most: pool slots, +1 if short."""
        estimate = self._runtimes.get(queue)
        mean = None if estimate is None else estimate.value
        return self.slots + 1 if mean is not None and mean < LOOKAHEAD_BELOW else self.slots

    def held(self, queue: str) -> int:
        """Tasks of limited ``queue`` this worker counts as holding a key slot."""
        with self._lock:
            return self._in_flight.get(queue, 0)

    def recount(self, queue: str, held: int) -> int:
        """This worker holds ``held`` tasks of ``queue``, fewer than it counts: a release
        was lost.  Count those; the fetch may take more of ``queue`` at once.

        The leases on the broker are not touched: the one whose release was lost
        expires after ``lease_ttl``.  Returns how many the count had too many.
        """
        with self._lock:
            extra = self._in_flight.get(queue, 0) - max(0, held)
            if extra <= 0:
                return 0
            self._in_flight[queue] = max(0, held)
        self.outbox.wake_fetch()
        return extra

    def reset(self, running_unreported: bool = False) -> list[tuple[str, str]]:
        """A new channel: the previous one's messages went back to the broker.

        ``running_unreported``: the pool will not report the finish of the
        tasks running now (see :func:`celery_fair.compat.pool_forgets_running_tasks`);
        their releases, ``(queue, delivery tag)``, are returned, to be sent
        rather than left held until their leases expire.
        """
        running: list[tuple[str, str]] = []
        with self._lock:
            if running_unreported:
                running = [
                    (queue, str(tag))
                    for tag, (state, queue) in self._tags.items()
                    if state != _FINISHED and queue is not None and queue in self.queues
                ]
            self._in_flight.clear()
            self._tags.clear()
        return running
