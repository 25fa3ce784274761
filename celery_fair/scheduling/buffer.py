"""The worker's buffer of tasks waiting for a pool slot, drained in DRR order.

Per-queue FIFO buffers; a :class:`~celery_fair.scheduling.drr.DeficitRoundRobin`
whose active list is exactly the set of non-empty buffers (a queue joins the
tail when its buffer gets a task and leaves, losing its positive deficit,
when the buffer empties: Shreedhar & Varghese's active list).  Each take is
O(1).  Costs are given by the caller (fixed, or a run-time estimate that is
corrected later with :meth:`FairBuffer.charge`: DRR++ post-charge).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from .drr import DeficitRoundRobin

__all__ = ("FairBuffer",)

T = TypeVar("T")


class FairBuffer(Generic[T]):
    """Tasks waiting for a slot, taken in DWRR order across their queues."""

    def __init__(self) -> None:
        self.drr = DeficitRoundRobin()
        self._items: dict[str, deque[T]] = {}
        self._size = 0

    def set_quanta(self, quanta: Mapping[str, float]) -> None:
        """Use these quanta (validated all at once)."""
        self.drr.set_quanta(quanta)

    def put(self, queue: str, item: T) -> None:
        """Buffer ``item`` of ``queue`` (FIFO within the queue)."""
        items = self._items.get(queue)
        if items is None:
            items = self._items[queue] = deque()
        items.append(item)
        self._size += 1
        if len(items) == 1:
            self.drr.activate(queue)

    def take(self, cost: Callable[[str], float]) -> tuple[str, T] | None:
        """Remove and return the next ``(queue, item)`` in DRR order."""
        queue = self.drr.head()
        if queue is None:
            return None
        items = self._items[queue]
        item = items.popleft()
        self._size -= 1
        self.drr.served(queue, cost(queue))
        if not items:
            self.drr.deactivate(queue)
        return queue, item

    def charge(self, queue: str, cost: float) -> None:
        """Post-charge a cost measured after the task ran."""
        if queue in self.drr.queues:
            self.drr.charge(queue, cost)

    def remove(self, queue: str, item: T) -> bool:
        """Take a specific item out (a revoked or returned task)."""
        items = self._items.get(queue)
        if not items:
            return False
        try:
            items.remove(item)
        except ValueError:
            return False
        self._size -= 1
        if not items:
            self.drr.deactivate(queue)
        return True

    def clear(self) -> list[T]:
        """Empty the buffer and return what it held."""
        held = [item for items in self._items.values() for item in items]
        for queue, items in self._items.items():
            if items:
                items.clear()
                self.drr.deactivate(queue)
        self._size = 0
        return held

    def counts(self) -> dict[str, int]:
        """Buffered tasks per queue."""
        return {queue: len(items) for queue, items in self._items.items()}

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for items in self._items.values():
            yield from items

    def __bool__(self) -> bool:
        return self._size > 0
