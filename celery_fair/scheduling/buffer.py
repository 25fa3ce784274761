"""The worker's buffer of tasks waiting for a pool slot, drained in DRR order.

Per-queue FIFO buffers; a :class:`~celery_fair.scheduling.drr.DeficitRoundRobin`
whose active list is exactly the set of non-empty buffers (a queue joins the
tail when its buffer gets a task and leaves, losing its positive deficit,
when the buffer empties: Shreedhar & Varghese's active list).  Each take is
O(1).  Costs are given by the caller (fixed, or a run-time estimate that is
corrected later with :meth:`FairBuffer.charge`: DRR++ post-charge).

Tasks of a keyed queue (:mod:`celery_fair.keys`) carry their key and their
priority level; within that queue they wait by level, then in start-time
fair order over the keys instead of FIFO, so a quiet key's task is not stuck
behind a flooding key's tasks already prefetched, nor an urgent task behind
batch work.  Every key counts one task per turn here (or its
cost, under ``fair_cost="dominant"``): the weights between keys act where
messages are fetched (the broker's script), and this buffer only holds the
prefetch window.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from .drr import DeficitRoundRobin

__all__ = ("FairBuffer",)

T = TypeVar("T")


class _KeyOrder(Generic[T]):
    """One queue's waiting tasks: by priority level, then in start-time fair order over keys.

    A task's level comes first (the lowest rank: on Redis, Kombu's priority
    step, 0 served first), so an urgent task prefetched after batch work
    does not wait behind it.  Within a level a task's tag is
    ``max(the level's virtual time, its key's last tag + 1)``; the lowest tag
    is taken first (FIFO among equal tags, and within a key).  The per-key
    tags are forgotten whenever the queue's buffer empties, so state never
    outlives the tasks buffered.  With two-level keys the turns go to each
    (key, user): a quiet user's task prefetched behind a flooding user's of
    the same key does not wait for them.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, T, str]] = []
        self._next: dict[tuple[int, str, str | None], float] = {}
        self._vt: dict[int, float] = {}
        self._seq = 0

    def append(
        self, item: T, key: str, level: int = 0, user: str | None = None, cost: float = 1.0
    ) -> None:
        turn = (level, key, user)
        tag = max(self._vt.get(level, 0.0), self._next.get(turn, 0.0))
        self._next[turn] = tag + cost
        heapq.heappush(self._heap, (level, tag, self._seq, item, key))
        self._seq += 1

    def popleft(self) -> T:
        level, tag, _, item, _ = heapq.heappop(self._heap)
        self._vt[level] = tag
        if not self._heap:
            self._next.clear()
            self._vt.clear()
        return item

    def take_key(self, key: str) -> list[T]:
        """Remove every task of ``key``, oldest first (a paused key's tasks go back)."""
        taken = sorted((e for e in self._heap if e[4] == key), key=lambda e: e[2])
        if taken:
            self._heap = [e for e in self._heap if e[4] != key]
            heapq.heapify(self._heap)
            if not self._heap:
                self.clear()
        return [e[3] for e in taken]

    def remove(self, item: T) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is item or entry[3] == item:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(item)

    def clear(self) -> None:
        self._heap.clear()
        self._next.clear()
        self._vt.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: (e[0], e[1], e[2])))


class FairBuffer(Generic[T]):
    """Tasks waiting for a slot, taken in DWRR order across their queues."""

    def __init__(self) -> None:
        self.drr = DeficitRoundRobin()
        self._items: dict[str, deque[T] | _KeyOrder[T]] = {}
        self._size = 0

    def set_quanta(self, quanta: Mapping[str, float]) -> None:
        """Use these quanta (validated all at once)."""
        self.drr.set_quanta(quanta)

    def put(
        self,
        queue: str,
        item: T,
        key: str | None = None,
        level: int = 0,
        user: str | None = None,
        cost: float = 1.0,
    ) -> None:
        """Buffer ``item`` of ``queue``: FIFO within the queue, or fair over ``key``s
        (and their ``user``s, with two-level keys).

        A keyed queue's tasks are taken by ``level`` first (the lowest first);
        within a level a key's turn advances by ``cost`` per task (start-time
        fair queueing: a key of tasks twice as costly gets half the turns).
        """
        items = self._items.get(queue)
        if items is None:
            items = self._items[queue] = deque() if key is None else _KeyOrder()
        if isinstance(items, _KeyOrder):
            items.append(item, key or "", level, user, cost)
        else:
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

    def take_key(self, queue: str, key: str) -> list[T]:
        """Remove every buffered task of ``key`` in keyed ``queue``, oldest first."""
        items = self._items.get(queue)
        if not isinstance(items, _KeyOrder):
            return []
        taken = items.take_key(key)
        self._size -= len(taken)
        if taken and not items:
            self.drr.deactivate(queue)
        return taken

    def counts(self) -> dict[str, int]:
        """Buffered tasks per queue."""
        return {queue: len(items) for queue, items in self._items.items()}

    def count(self, queue: str) -> int:
        """Buffered tasks of ``queue``."""
        items = self._items.get(queue)
        return 0 if items is None else len(items)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for items in self._items.values():
            yield from items

    def __bool__(self) -> bool:
        return self._size > 0
