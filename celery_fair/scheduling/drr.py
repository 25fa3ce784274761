"""Deficit Weighted Round Robin with DRR++ post-charge: the pure scheduling core.

Shreedhar & Varghese, "Efficient Fair Queuing using Deficit Round Robin"
(SIGCOMM 1995): each queue has a quantum Q[i] and a deficit counter.  The
scheduler visits the *active list* (queues believed to have work) in order; a
visit adds Q[i] to the queue's deficit, and the queue is served while its
deficit stays positive, each service subtracting the message's cost.  Over
any interval in which queues i and j stay backlogged, the cost served per
unit of quantum differs by at most one quantum plus one maximum cost, so
queue i receives Q[i] / sum(Q) of the capacity.

Two refinements come from fq_codel (RFC 8290, section 4.2):

* the queue is served while ``deficit > 0`` and the cost is charged *after*
  the service (DRR++).  The cost may therefore be unknown when the decision
  is made (a task's run time); :meth:`DeficitRoundRobin.charge` adds it later
  and the deficit may go negative: the debt is paid in later rounds, because
  a visit that leaves the deficit non-positive ends at once;
* a queue found empty leaves the active list and loses its positive deficit
  (no hoarded credit, so the scheduler stays work-conserving); a debt is kept
  so that post-charged cost is never forgiven.

Every operation is O(1): the active list is a deque of (queue, generation)
entries.  Removing a queue from the middle only bumps its generation, and the
stale entry is discarded when it reaches the head (lazy deletion, amortised
O(1)).  A dict used as an ordered set would not do: popping its first key
and re-inserting it leaves holes at the front of its entry array, so finding
the head costs O(n) between compactions.  A decision may skip queues whose
deficit is exhausted, but each skip adds a quantum, so the skips per service
are bounded by max cost / min quantum whatever the number of queues (the
classic DRR bound).

The core reads no clock and imports nothing from Celery or Kombu.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ..grammar import as_positive

__all__ = ("DRRStatistics", "DeficitRoundRobin", "QueueStatistics")


@dataclass(frozen=True)
class QueueStatistics:
    """One queue's scheduling state, as a plain record."""

    name: str
    quantum: float
    deficit: float
    active: bool
    served_count: int
    served_cost: float
    empty_resets: int


@dataclass(frozen=True)
class DRRStatistics:
    """A snapshot of a :class:`DeficitRoundRobin`."""

    queues: tuple[QueueStatistics, ...]
    head: str | None
    decisions: int
    visits: int

    def as_dict(self) -> dict[str, object]:
        """Return the record as JSON-friendly nested dicts."""
        return {
            "head": self.head,
            "decisions": self.decisions,
            "visits": self.visits,
            "queues": {
                q.name: {
                    "quantum": q.quantum,
                    "deficit": q.deficit,
                    "active": q.active,
                    "served_count": q.served_count,
                    "served_cost": q.served_cost,
                    "empty_resets": q.empty_resets,
                }
                for q in self.queues
            },
        }


class _Queue:
    __slots__ = ("name", "quantum", "deficit", "served_count", "served_cost", "empty_resets")

    def __init__(self, name: str, quantum: float) -> None:
        self.name = name
        self.quantum = quantum
        self.deficit = 0.0
        self.served_count = 0
        self.served_cost = 0.0
        self.empty_resets = 0


def check_quantum(name: str, quantum: object) -> float:
    """Return ``quantum`` as a float, or raise ValueError naming the queue."""
    value = as_positive(quantum)
    if value is None:
        raise ValueError(f"quantum of queue {name!r} must be a positive number, got {quantum!r}")
    return value


class DeficitRoundRobin:
    """Deficit Weighted Round Robin over named queues.

    ``quanta`` maps queue names to quanta (positive numbers); a queue added
    without one gets ``default_quantum``.  The caller drives it with:

    * :meth:`activate` when a queue gets work, :meth:`deactivate` when it is
      found empty (or :meth:`pass_over` to end its visit but keep it listed);
    * :meth:`head` to learn which queue to serve next, then
      :meth:`served` with the cost known at that time (0 for post-charge);
    * :meth:`charge` to add cost measured later (DRR++ post-charge).
    """

    def __init__(
        self, quanta: Mapping[str, float] | None = None, *, default_quantum: float = 1.0
    ) -> None:
        self.default_quantum = check_quantum("<default>", default_quantum)
        self._queues: dict[str, _Queue] = {}
        # The DRR active list: (name, generation) entries; an entry is live
        # while its generation is the queue's current one (lazy deletion).
        self._ring: deque[tuple[str, int]] = deque()
        self._active: dict[str, int] = {}
        # Whether the current head has received its quantum for this visit.
        self._visit_open = False
        self._generation = 0
        self._decisions = 0
        self._visits = 0
        for name, quantum in (quanta or {}).items():
            self.add(name, quantum)

    # -- membership -------------------------------------------------------

    def add(self, name: str, quantum: float | None = None) -> None:
        """Add a queue (inactive) or change the quantum of a known one."""
        value = self.default_quantum if quantum is None else check_quantum(name, quantum)
        queue = self._queues.get(name)
        if queue is None:
            self._queues[name] = _Queue(name, value)
        else:
            queue.quantum = value

    def remove(self, name: str) -> None:
        """Forget a queue entirely."""
        self.deactivate(name)
        self._queues.pop(name, None)

    def set_quanta(self, quanta: Mapping[str, float]) -> None:
        """Change several quanta at once; all are validated before any change."""
        checked = {name: check_quantum(name, q) for name, q in quanta.items()}
        for name, value in checked.items():
            self.add(name, value)

    def quantum(self, name: str) -> float:
        """The quantum of ``name`` (the default for an unknown queue)."""
        queue = self._queues.get(name)
        return self.default_quantum if queue is None else queue.quantum

    def deficit(self, name: str) -> float:
        """The deficit counter of ``name``."""
        return self._queue(name).deficit

    @property
    def queues(self) -> tuple[str, ...]:
        """All known queue names, in the order they were added."""
        return tuple(self._queues)

    @property
    def active(self) -> tuple[str, ...]:
        """The active list, head first."""
        return tuple(name for name, gen in self._ring if self._active.get(name) == gen)

    def __contains__(self, name: object) -> bool:
        return name in self._queues

    def is_active(self, name: str) -> bool:
        return name in self._active

    # -- the active list --------------------------------------------------

    def activate(self, name: str) -> None:
        """Mark ``name`` as having work: it joins the tail of the active list."""
        if name not in self._queues:
            self.add(name)
        if name not in self._active:
            self._generation += 1
            self._active[name] = self._generation
            self._ring.append((name, self._generation))

    def deactivate(self, name: str) -> None:
        """``name`` was found empty: drop it from the active list.

        Its positive deficit is reset (no hoarding); a post-charge debt stays.
        """
        if name not in self._active:
            return
        if self._visit_open and self._first() == name:
            self._visit_open = False
        del self._active[name]  # its ring entry is now stale
        self._reset(name)

    def pass_over(self, name: str) -> None:
        """End ``name``'s visit as if found empty, but keep it in the list.

        Used where emptiness is only observed, not known (a polling
        transport): the queue stays eligible and is probed again next round.
        """
        if name not in self._active:
            return
        if self._visit_open and self._first() == name:
            self._visit_open = False
        self._reset(name)
        self._to_tail(name)

    def defer(self, name: str) -> None:
        """End ``name``'s visit although it has work it cannot take now.

        Unlike :meth:`pass_over` the queue keeps its credit, capped at one
        quantum (so it is not hoarded across rounds), and any debt.
        """
        if name not in self._active:
            return
        if self._visit_open and self._first() == name:
            self._visit_open = False
        queue = self._queues[name]
        queue.deficit = min(queue.deficit, queue.quantum)
        self._to_tail(name)

    def forgive(self, name: str) -> None:
        """Cancel ``name``'s debt (a negative deficit); a credit is kept.

        For a queue that ran up the debt while no other queue had work: DRR
        with only that queue on the active list would have granted it quanta
        until it could be served, so there is nobody to repay.
        """
        queue = self._queue(name)
        if queue.deficit < 0:
            queue.deficit = 0.0

    def _to_tail(self, name: str) -> None:
        if self._ring and self._ring[0][0] == name and self._live(self._ring[0]):
            self._ring.rotate(-1)
            return
        self._generation += 1
        self._active[name] = self._generation
        self._ring.append((name, self._generation))

    def _live(self, entry: tuple[str, int]) -> bool:
        return self._active.get(entry[0]) == entry[1]

    def _reset(self, name: str) -> None:
        queue = self._queues[name]
        if queue.deficit > 0:
            queue.deficit = 0.0
        queue.empty_resets += 1

    # -- decisions --------------------------------------------------------

    def head(self) -> str | None:
        """Return the queue to serve next, or None when no queue is active.

        Visits that find the deficit exhausted end here: the queue moves to
        the tail and the next one receives its quantum.
        """
        active = self._active
        while active:
            name = self._first()
            queue = self._queues[name]
            if not self._visit_open:
                queue.deficit += queue.quantum
                self._visit_open = True
                self._visits += 1
            if queue.deficit > 0:
                return name
            self._ring.rotate(-1)  # the head is live: _first() pruned stale entries
            self._visit_open = False
        return None

    def order(self) -> Iterator[str]:
        """Yield every active queue, the one DRR would serve first first.

        The head (with its visit opened), then the others in the order the
        round would reach a visit that serves them.
        """
        first = self.head()
        if first is None:
            return
        yield first
        # Then the queues whose next visit will serve (deficit + quantum > 0),
        # in round order, then those still paying off debt or accumulating
        # credit: the order in which DRR would reach them.
        live, queues = self._live, self._queues
        later: list[str] = []
        for entry in list(self._ring)[1:]:
            if live(entry):
                queue = queues[entry[0]]
                if queue.deficit + queue.quantum > 0:
                    yield queue.name
                else:
                    later.append(queue.name)
        yield from later

    def served(self, name: str, cost: float = 1.0) -> None:
        """Record that one message of ``name`` was served, charging ``cost``.

        ``cost`` is the fixed message cost, or 0 (or an estimate) when the
        real cost is post-charged with :meth:`charge`.
        """
        queue = self._queue(name)
        self._decisions += 1
        queue.served_count += 1
        queue.deficit -= cost
        queue.served_cost += cost

    def charge(self, name: str, cost: float) -> None:
        """Post-charge ``cost`` (DRR++): may drive the deficit negative."""
        queue = self._queue(name)
        queue.deficit -= cost
        queue.served_cost += cost

    def next(self, cost: float = 1.0) -> str | None:
        """Serve the head once: ``head()`` then ``served(head, cost)``."""
        name = self.head()
        if name is not None:
            self.served(name, cost)
        return name

    # -- introspection ----------------------------------------------------

    def statistics(self) -> DRRStatistics:
        """A frozen snapshot of every queue's state."""
        return DRRStatistics(
            queues=tuple(
                QueueStatistics(
                    name=q.name,
                    quantum=q.quantum,
                    deficit=q.deficit,
                    active=q.name in self._active,
                    served_count=q.served_count,
                    served_cost=q.served_cost,
                    empty_resets=q.empty_resets,
                )
                for q in self._queues.values()
            ),
            head=self._first() if self._active else None,
            decisions=self._decisions,
            visits=self._visits,
        )

    def _first(self) -> str:
        ring, active = self._ring, self._active
        while active.get(ring[0][0]) != ring[0][1]:
            ring.popleft()  # a stale entry: that queue left or moved
        return ring[0][0]

    def _queue(self, name: str) -> _Queue:
        try:
            return self._queues[name]
        except KeyError:
            raise KeyError(f"unknown queue {name!r}") from None

    def __repr__(self) -> str:
        return f"<DeficitRoundRobin queues={len(self._queues)} active={len(self._active)}>"
