"""The fair scheduler of one worker: a thin facade over its named parts.

This is the one scheduler a worker has.  It holds the weights and composes:

* :class:`~celery_fair.scheduling.fetch.FetchRound`: DWRR where messages are
  fetched (the poll order, per-queue credit, AMQP window sizing), the
  design's one law;
* :class:`~celery_fair.scheduling.dispatch.DispatchRound`: the tasks waiting
  for a pool slot, taken in DWRR order with the same weights;
* :class:`~celery_fair.scheduling.cost.CostModel`: what a message costs (1,
  or its run-time estimate, post-charged when it finishes).

The facade keeps both rounds' quanta in step with the weights and routes
each event (fetched, released, finished) to the parts that need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..grammar import as_positive_int
from .cost import COST_MODES, CostMode, CostModel
from .dispatch import DispatchRound
from .drr import DRRStatistics, check_quantum
from .fetch import FetchRound

__all__ = ("COST_MODES", "CostMode", "FairScheduler", "SchedulerStatistics")


@dataclass(frozen=True)
class SchedulerStatistics:
    """A snapshot of a :class:`FairScheduler`."""

    cost: str
    weights: Mapping[str, float]
    held: Mapping[str, int]
    credit: Mapping[str, int | None]
    cost_estimate: Mapping[str, float | None]
    fetched: Mapping[str, int]
    waiting: Mapping[str, int]
    drr: DRRStatistics
    dispatch: DRRStatistics

    def as_dict(self) -> dict[str, object]:
        """Return the record as JSON-friendly nested dicts."""
        return {
            "cost": self.cost,
            "weights": dict(self.weights),
            "held": dict(self.held),
            "credit": dict(self.credit),
            "cost_estimate": dict(self.cost_estimate),
            "fetched": dict(self.fetched),
            "waiting": dict(self.waiting),
            "drr": self.drr.as_dict(),
            "dispatch": self.dispatch.as_dict(),
        }


class FairScheduler:
    """Weighted fair fetch and dispatch decisions for the queues one worker consumes.

    ``weights`` maps queue names to weights; consumed queues without one get
    ``default_weight``.  ``runtime_quantum`` is the cost unit (seconds) in
    runtime mode: a queue of the smallest weight may run about that much per
    DRR visit.  ``credit`` is a fixed per-queue limit of held messages, or
    None to derive it from the prefetch window as ``window - reserve``.
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        cost: CostMode = "count",
        default_weight: float = 1.0,
        runtime_quantum: float = 0.001,
        credit: int | None = None,
        reserve: int = 1,
    ) -> None:
        self.costs = CostModel(cost, runtime_quantum=runtime_quantum)
        self.default_weight = check_quantum("<default>", default_weight)
        if credit is not None and as_positive_int(credit) is None:
            raise ValueError(f"credit must be a positive integer or None, got {credit!r}")
        self._weights: dict[str, float] = {
            name: check_quantum(name, w) for name, w in (weights or {}).items()
        }
        self.fetch = FetchRound(
            self.weight,
            self.costs,
            credit=credit,
            reserve=reserve,
            on_new_queue=self._apply_quanta,
        )
        #: Tasks waiting for a pool slot, taken in DRR order (same weights).
        self.dispatch: DispatchRound[object] = DispatchRound(self.costs)

    @property
    def cost(self) -> CostMode:
        return self.costs.mode

    @property
    def runtime_quantum(self) -> float:
        return self.costs.runtime_quantum

    # -- queues and weights -------------------------------------------------

    def weight(self, queue: str) -> float:
        """The configured weight of ``queue`` (the default when unset)."""
        return self._weights.get(queue, self.default_weight)

    @property
    def queues(self) -> tuple[str, ...]:
        return self.fetch.queues

    def set_queues(self, queues: Iterable[str]) -> None:
        """Make the consumed queues exactly ``queues`` (in that order)."""
        wanted = list(dict.fromkeys(queues))
        for name in set(self.fetch.queues) - set(wanted):
            self.fetch.remove(name)
        for name in wanted:
            self.fetch.adopt(name)
            # On a polling transport every consumed queue stays in the
            # active list; emptiness is observed per poll (pass_over).
            self.fetch.drr.activate(name)
        self._apply_quanta()

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change weights at run time; all are validated before any change."""
        checked = {name: check_quantum(name, w) for name, w in weights.items()}
        self._weights.update(checked)
        self._apply_quanta()

    @property
    def weights(self) -> dict[str, float]:
        """The weight in force for every consumed queue."""
        return {name: self.weight(name) for name in self.fetch.queues}

    def _apply_quanta(self) -> None:
        quanta = self.costs.quanta(self.weights)
        if quanta:
            self.fetch.drr.set_quanta(quanta)
            self.dispatch.set_quanta(quanta)

    # -- fetch decisions (see FetchRound) -------------------------------------

    def push_windows(self, total: int, cap: int | None = None) -> dict[str, int]:
        """Per-queue prefetch windows for a push transport (AMQP)."""
        return self.fetch.push_windows(total, cap)

    def credit(self, queue: str, window: int | None) -> int | None:
        """How many unacknowledged messages ``queue`` may hold before demotion."""
        return self.fetch.credit(queue, window)

    def fetch_order(self, window: int | None = None) -> list[str]:
        """The order in which to poll the consumed queues, best first."""
        return self.fetch.order(window)

    def fetch_run(self, queue: str, window: int | None = None) -> int:
        """How many messages of ``queue``, the first of the fetch order, one fetch may take."""
        return self.fetch.run(queue, window)

    def fetched(self, queue: str, skipped: Sequence[str] = ()) -> None:
        """A message of ``queue`` was fetched; ``skipped`` were polled first."""
        self.fetch.fetched(queue, skipped)

    def released(self, queue: str) -> None:
        """A held message of ``queue`` was acknowledged, rejected or restored."""
        self.fetch.released(queue)

    def finished(self, queue: str, runtime: float) -> None:
        """A message of ``queue`` ran for ``runtime`` seconds.

        In runtime mode this post-charges, in both rounds, the difference
        between the measured run time and the estimate charged before.
        """
        if not self.costs.runtime or not self.fetch.tracks(queue):
            return
        runtime = max(0.0, float(runtime))
        self.fetch.finished(queue, runtime)
        self.dispatch.finished(queue, runtime)
        self.costs.observe(queue, runtime)

    def discarded(self, queue: str) -> None:
        """A fetched message of ``queue`` will not run here: refund its estimate."""
        self.fetch.discarded(queue)

    def fetch_cost(self, queue: str) -> float:
        """What a message of ``queue`` is charged: 1, or its run-time estimate."""
        return self.costs.cost(queue)

    def reset_held(self) -> None:
        """Forget all held messages (a new channel holds none)."""
        self.fetch.reset_held()
        self.dispatch.forget_pending()

    def held(self, queue: str) -> int:
        return self.fetch.held(queue)

    # -- dispatch: tasks waiting for a pool slot (see DispatchRound) ----------

    def wait(
        self,
        queue: str,
        item: object,
        key: str | None = None,
        level: int = 0,
        user: str | None = None,
        cost: float = 1.0,
        user_cost: float | None = None,
    ) -> None:
        """Buffer a task of ``queue`` until a pool slot is free.

        ``key`` and ``level``: a keyed queue's key and priority level (the lowest
        level is taken first); ``user``: its user within the key (two-level keys);
        ``cost``: what the key's turn in this buffer advances by (1, or its
        dominant cost; on RabbitMQ divided by the key's weight); ``user_cost``:
        what the user's turn within the key advances by (default: ``cost``).
        """
        if self.fetch.adopt(queue):
            self._apply_quanta()
        self.dispatch.put(queue, item, key, level, user, cost, user_cost)

    # -- introspection ------------------------------------------------------

    def statistics(self, window: int | None = None) -> SchedulerStatistics:
        """A frozen snapshot: weights, held messages, credit and DRR state."""
        names = self.fetch.queues
        return SchedulerStatistics(
            cost=self.cost,
            weights=self.weights,
            held=self.fetch.held_counts(),
            credit={n: self.fetch.credit(n, window) for n in names},
            cost_estimate=self.costs.estimates(names),
            fetched=self.fetch.fetched_counts(),
            waiting=self.dispatch.counts(),
            drr=self.fetch.statistics(),
            dispatch=self.dispatch.statistics(),
        )
