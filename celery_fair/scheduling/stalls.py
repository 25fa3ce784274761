"""Stalls: a task that waits in the worker while a pool process is free.

A worker's books (free slots, the dispatch buffer, per-key leases) are kept by
callbacks, and a callback can be lost: a child replaced after
``--max-tasks-per-child``, a process killed by a hard time limit or the OOM
killer, a child that never comes up.  Waiting is normal while every process
is busy; waiting while one is free, for longer than a task takes to reach
it, means the books drifted from the pool.  :class:`StallWatch` is told, at
each look, which tasks wait and how many processes are free; a task that
has waited with a process free at every look for ``after`` seconds is a
stall, reported once.  A look that finds no process free starts every wait
again: the pool was busy, nothing was stranded.

Pure: the caller passes the time (monotonic seconds) and what it read from
the pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

__all__ = (
    "BUFFER", "LEASES", "LOST", "PLACES", "POOL", "Stall", "StallStatistics", "StallWatch",
)  # fmt: skip

#: Where a task waits: in celery-fair's buffer, before the pool; handed to the
#: pool and not started; counted as running on a pool process that is gone;
#: or (not a task) a keyed queue's fetch held back by a count of key slots the
#: worker does not hold.
BUFFER, POOL, LOST, LEASES = "buffer", "pool", "lost", "leases"
PLACES = (BUFFER, POOL, LOST, LEASES)


@dataclass(frozen=True)
class Stall:
    """One task found waiting while a pool process was free."""

    task: Hashable
    #: Where it waited: one of :data:`PLACES`.
    place: str
    #: Seconds it has waited with a process free.
    waited: float
    free: int
    size: int


@dataclass(frozen=True)
class StallStatistics:
    """A :class:`StallWatch`'s counters, as a plain record."""

    after: float
    #: Stalled tasks found, each counted once, by where they waited.
    stalls: dict[str, int]
    #: Pool slots given back by repairs of the worker's count.
    repaired: int
    #: Tasks waiting with a process free at the last look.
    watching: int


class StallWatch:
    """Finds tasks that wait while a pool process is free for ``after`` seconds."""

    def __init__(self, after: float) -> None:
        if not after > 0:
            raise ValueError(f"after must be a positive number of seconds, got {after!r}")
        self.after = float(after)
        self._since: dict[Hashable, float] = {}
        self._reported: set[Hashable] = set()
        self._stalls: dict[str, int] = {}
        self._repaired = 0

    def look(
        self, now: float, waiting: Mapping[Hashable, str], free: int, size: int
    ) -> list[Stall]:
        """One look at the worker: ``waiting`` maps each waiting task to where it waits.

        Returns the tasks that became stalls at this look (each task once,
        for as long as it keeps waiting).
        """
        if free <= 0 or not waiting:
            self._since.clear()
            self._reported &= set(waiting)
            return []
        since = {task: self._since.get(task, now) for task in waiting}
        self._since = since
        self._reported &= since.keys()
        found = []
        for task, first in since.items():
            waited = now - first
            if waited >= self.after and task not in self._reported:
                self._reported.add(task)
                place = waiting[task]
                self._stalls[place] = self._stalls.get(place, 0) + 1
                found.append(Stall(task, place, waited, free, size))
        return found

    def repaired(self, slots: int) -> None:
        """Count ``slots`` given back to the pool by a repair."""
        self._repaired += max(0, slots)

    def statistics(self) -> StallStatistics:
        return StallStatistics(
            after=self.after,
            stalls=dict(self._stalls),
            repaired=self._repaired,
            watching=len(self._since),
        )
