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
batch work.  On Redis every key counts one task per turn here (or its
cost, under ``fair_cost="dominant"``): the weights between keys act where
messages are fetched (the broker's script), and this buffer only holds the
prefetch window.  On RabbitMQ no script orders the keys, so the caller
divides each task's cost by its key's weight (and its user's, with
two-level keys) and the weights act here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from itertools import count
from typing import Generic, TypeVar, cast

from .drr import DeficitRoundRobin

__all__ = ("FairBuffer",)

T = TypeVar("T")


#: A key's turn whose task is taken from the key's own order over its users.
_USERS = object()


class _KeyOrder(Generic[T]):
    """One queue's waiting tasks: by priority level, then in start-time fair order over keys.

    A task's level comes first: strictly, the lowest rank first (on Redis,
    Kombu's priority step, 0 served first), so an urgent task prefetched
    after batch work does not wait behind it; or, with ``level_weights``
    (``fair_priority="weighted"``), the levels holding tasks share the takes
    by weight in start-time fair order (a level's next tag is its last plus
    ``1 / weight``, an idle level banks no credit; equal tags: the lower
    rank).  Within a level a task's tag is ``max(the level's virtual time,
    its key's last tag + 1)``; the lowest tag is taken first (FIFO among
    equal tags, and within a key).  The per-key tags are forgotten whenever
    the queue's buffer empties, so state never outlives the tasks buffered.

    With two-level keys the order is hierarchical, as the Redis fetch's
    (docs/fairness-keys.md): a task with a user gives its key a turn
    (``_USERS``) in this order, and the key's own ``_KeyOrder`` over its
    users decides which of the key's tasks of that turn's level it serves.
    A flooding user's prefetched tasks then take only their key's turns, and
    a quiet user of the same key is not behind them.  The key keeps as many
    turns per level as it has tasks per level.
    """

    def __init__(
        self,
        seq: Iterator[int] | None = None,
        level_weights: Mapping[int, float] | None = None,
    ) -> None:
        #: Level -> its heap of (tag, seq, task or _USERS, key); only levels with tasks.
        self._levels: dict[int, list[tuple[float, int, object, str]]] = {}
        self._size = 0
        self._next: dict[tuple[int, str, str | None], float] = {}
        self._vt: dict[int, float] = {}
        self._seq = count() if seq is None else seq
        self._users: dict[str, _KeyOrder[T]] = {}
        self.level_weights = None if level_weights is None else dict(level_weights)
        #: Weighted levels: each level's start tag, and the virtual time over levels.
        self._level_tags: dict[int, float] = {}
        self._level_vt = 0.0

    def append(
        self,
        item: T,
        key: str,
        level: int = 0,
        user: str | None = None,
        cost: float = 1.0,
        user_cost: float | None = None,
    ) -> None:
        entry: object = item
        if user is not None:
            users = self._users.get(key)
            if users is None:
                users = self._users[key] = _KeyOrder(self._seq)
            users.append(item, user, level, cost=cost if user_cost is None else user_cost)
            entry = _USERS
        turn = (level, key, None)
        tag = max(self._vt.get(level, 0.0), self._next.get(turn, 0.0))
        self._next[turn] = tag + cost
        heap = self._levels.get(level)
        if heap is None:
            heap = self._levels[level] = []
            if self.level_weights is not None:
                # A level that comes back starts at the levels' virtual time: no credit banked.
                self._level_tags[level] = max(self._level_vt, self._level_tags.get(level, 0.0))
        heapq.heappush(heap, (tag, next(self._seq), entry, key))
        self._size += 1

    def restart_levels(self) -> None:
        """Every level with tasks starts again at the levels' virtual time (new weights)."""
        self._level_tags = dict.fromkeys(self._levels, self._level_vt)

    def _next_level(self) -> int:
        """The level the next take serves, charged for it here (start-time fair
        queueing charges at selection: the chosen level's next tag moves on)."""
        weights = self.level_weights
        if weights is None:
            return min(self._levels)
        level = min(self._levels, key=lambda lv: (self._level_tags.get(lv, 0.0), lv))
        start = self._level_tags.get(level, 0.0)
        self._level_vt = start
        self._level_tags[level] = start + 1.0 / float(weights.get(level, 1.0))
        return level

    def popleft(self, level: int | None = None) -> T:
        """The next task: of the next level in order, or of ``level`` (a key's turn
        of that level, taken from the key's order over its users)."""
        if level is None:
            level = self._next_level()
        heap = self._levels[level]
        tag, _, entry, key = heapq.heappop(heap)
        if not heap:
            del self._levels[level]
        self._size -= 1
        self._vt[level] = tag
        if entry is _USERS:
            users = self._users[key]
            item = users.popleft(level)
            if not users:
                del self._users[key]
        else:
            item = cast(T, entry)
        if not self._size:
            self.clear()
        return item

    def _entries(self) -> Iterator[tuple[int, tuple[float, int, object, str]]]:
        for level, heap in self._levels.items():
            for entry in heap:
                yield level, entry

    def _taken(self) -> list[tuple[int, T]]:
        """Every task with its sequence number (its users' tasks, for a key's turns)."""
        found = [(e[1], cast(T, e[2])) for _, e in self._entries() if e[2] is not _USERS]
        for users in self._users.values():
            found.extend(users._taken())
        return found

    def take_key(self, key: str) -> list[T]:
        """Remove every task of ``key``, oldest first (a paused key's tasks go back)."""
        taken = [
            (e[1], cast(T, e[2])) for _, e in self._entries() if e[3] == key and e[2] is not _USERS
        ]
        users = self._users.pop(key, None)
        if users is not None:
            taken.extend(users._taken())
        for level, heap in list(self._levels.items()):
            kept = [e for e in heap if e[3] != key]
            if len(kept) != len(heap):
                self._size -= len(heap) - len(kept)
                if kept:
                    heapq.heapify(kept)
                    self._levels[level] = kept
                else:
                    del self._levels[level]
        if not self._size:
            self.clear()
        return [item for _, item in sorted(taken, key=lambda pair: pair[0])]

    def remove(self, item: T) -> None:
        for level, heap in self._levels.items():
            for i, entry in enumerate(heap):
                if entry[2] is item or entry[2] == item:
                    self._drop(level, i)
                    return
        for key, users in self._users.items():
            found = users.level_of(item)
            if found is None:
                continue
            users.remove(item)
            if not users:
                del self._users[key]
            # The key gives up its latest turn of that level.
            heap = self._levels[found]
            turns = [i for i, e in enumerate(heap) if e[3] == key and e[2] is _USERS]
            self._drop(found, max(turns, key=lambda i: (heap[i][0], heap[i][1])))
            return
        raise ValueError(item)

    def level_of(self, item: T) -> int | None:
        """The level ``item`` waits at (None: not here)."""
        for level, entry in self._entries():
            if entry[2] is item or entry[2] == item:
                return level
        for users in self._users.values():
            found = users.level_of(item)
            if found is not None:
                return found
        return None

    def _drop(self, level: int, index: int) -> None:
        heap = self._levels[level]
        heap[index] = heap[-1]
        heap.pop()
        if heap:
            heapq.heapify(heap)
        else:
            del self._levels[level]
        self._size -= 1
        if not self._size:
            self.clear()

    def clear(self) -> None:
        self._levels.clear()
        self._size = 0
        self._next.clear()
        self._vt.clear()
        self._users.clear()
        self._level_tags.clear()
        self._level_vt = 0.0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        """The tasks by level, then in key order (with weighted levels, not the order
        of the takes, which interleave the levels)."""
        users = {key: iter(order) for key, order in self._users.items()}
        for _, entry in sorted(self._entries(), key=lambda e: (e[0], e[1][0], e[1][1])):
            yield next(users[entry[3]]) if entry[2] is _USERS else cast(T, entry[2])


class FairBuffer(Generic[T]):
    """Tasks waiting for a slot, taken in DWRR order across their queues."""

    def __init__(self) -> None:
        self.drr = DeficitRoundRobin()
        self._items: dict[str, deque[T] | _KeyOrder[T]] = {}
        self._size = 0
        #: Keyed queue -> its priority levels' weights (``fair_priority="weighted"``
        #: where the worker's buffer orders the levels: RabbitMQ).
        self._level_weights: dict[str, dict[int, float]] = {}

    def set_level_weights(self, queue: str, weights: Mapping[int, float] | None) -> None:
        """Keyed ``queue``'s levels share the takes by these weights (by level rank;
        a rank not given weighs 1); None: strictly, the lowest rank first."""
        if weights is None:
            self._level_weights.pop(queue, None)
        else:
            self._level_weights[queue] = {level: float(w) for level, w in weights.items()}
        items = self._items.get(queue)
        if isinstance(items, _KeyOrder):
            # Tasks already buffered: the levels start even, at the levels' virtual time.
            items.level_weights = self._level_weights.get(queue)
            items.restart_levels()

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
        user_cost: float | None = None,
    ) -> None:
        """Buffer ``item`` of ``queue``: FIFO within the queue, or fair over ``key``s
        (and, with two-level keys, over each key's ``user``s within its turns).

        A keyed queue's tasks are taken by ``level`` first (the lowest first, or by
        the queue's level weights: :meth:`set_level_weights`);
        within a level a key's turn advances by ``cost`` per task (start-time
        fair queueing: a key of tasks twice as costly gets half the turns), and
        a user's turn within its key by ``user_cost`` (default: ``cost``).
        """
        items = self._items.get(queue)
        if items is None:
            items = self._items[queue] = (
                deque() if key is None else _KeyOrder(level_weights=self._level_weights.get(queue))
            )
        if isinstance(items, _KeyOrder):
            items.append(item, key or "", level, user, cost, user_cost)
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
