"""The fair scheduler of one worker: weights, costs and per-queue credit.

This is the one scheduler a worker has.  It owns a single
:class:`~celery_fair.scheduling.drr.DeficitRoundRobin` and decides *where
messages are fetched* (the design's one law: in steady state a queue is
consumed exactly as fast as it is fetched, so a weight that acts only on
the worker's buffer does nothing).

A polling transport asks :meth:`FairScheduler.fetch_order` for the order in
which to poll its queues, and reports what it got with
:meth:`FairScheduler.fetched`.  Queues that are not the first in the order
and yet were passed over by the broker were empty (or held back by credit):
their visit ends, as DRR prescribes for an empty queue.

Costs: in ``"count"`` mode every message costs one unit.  In ``"runtime"``
mode a message is charged an estimate of its run time when fetched (the
queue's moving average) and the difference to the measured run time when it
finishes (DRR++ post-charge, RFC 8290): the sum charged per queue is exactly
the measured run time once the messages have finished.

Credit: a queue that holds ``credit`` or more unacknowledged messages moves
to the *end* of the poll order, behind every queue that is below its credit,
so one busy queue cannot keep the others out of the prefetch window.  It is
demoted, not excluded: a BRPOP that leaves a backlogged queue out would block
until its timeout even after that queue became eligible again, idling the
worker.  A queue's credit is ``window - reserve`` (room kept for the others)
or twice its expected share of the fetches times the window, whichever is
larger, so credit never binds on a queue that is only taking its fair share
(in runtime mode, a queue of short tasks takes most of the fetches).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .buffer import FairBuffer
from .drr import DeficitRoundRobin, DRRStatistics, check_quantum
from .estimate import Ewma

__all__ = ("COST_MODES", "CostMode", "FairScheduler", "SchedulerStatistics")

CostMode = Literal["count", "runtime"]
COST_MODES: tuple[str, ...] = ("count", "runtime")


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
    """Weighted fair fetch decisions for the queues one worker consumes.

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
        if cost not in COST_MODES:
            raise ValueError(f"cost must be one of {COST_MODES}, got {cost!r}")
        self.cost: CostMode = cost
        self.default_weight = check_quantum("<default>", default_weight)
        self.runtime_quantum = check_quantum("<runtime quantum>", runtime_quantum)
        if credit is not None and (isinstance(credit, bool) or int(credit) < 1):
            raise ValueError(f"credit must be a positive integer or None, got {credit!r}")
        self.credit_limit = credit
        self.reserve = max(0, int(reserve))
        self._weights: dict[str, float] = {
            name: check_quantum(name, w) for name, w in (weights or {}).items()
        }
        self._drr = DeficitRoundRobin()
        self._held: dict[str, int] = {}
        self._fetched: dict[str, int] = {}
        self._estimates: dict[str, Ewma] = {}
        self._pending: dict[str, deque[float]] = {}
        self._global_estimate = Ewma()
        #: Tasks waiting for a pool slot, taken in DRR order (same weights).
        self.waiting: FairBuffer[object] = FairBuffer()
        self._wait_pending: dict[str, deque[float]] = {}
        #: Queues the last fetch order polled last for holding their credit.
        self._demoted: set[str] = set()

    # -- queues and weights -------------------------------------------------

    def weight(self, queue: str) -> float:
        """The configured weight of ``queue`` (the default when unset)."""
        return self._weights.get(queue, self.default_weight)

    @property
    def queues(self) -> tuple[str, ...]:
        return self._drr.queues

    def set_queues(self, queues: Iterable[str]) -> None:
        """Make the consumed queues exactly ``queues`` (in that order)."""
        wanted = list(dict.fromkeys(queues))
        for name in set(self._drr.queues) - set(wanted):
            self._drr.remove(name)
        for name in wanted:
            self._adopt(name)
            # On a polling transport every consumed queue stays in the
            # active list; emptiness is observed per poll (pass_over).
            self._drr.activate(name)
        self._apply_quanta()

    def _adopt(self, queue: str) -> bool:
        """Start tracking ``queue``; True if the DRR did not know it yet."""
        self._held.setdefault(queue, 0)
        self._fetched.setdefault(queue, 0)
        if queue in self._drr:
            return False
        self._drr.add(queue)
        return True

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change weights at run time; all are validated before any change."""
        checked = {name: check_quantum(name, w) for name, w in weights.items()}
        self._weights.update(checked)
        self._apply_quanta()

    @property
    def weights(self) -> dict[str, float]:
        """The weight in force for every consumed queue."""
        return {name: self.weight(name) for name in self._drr.queues}

    def _apply_quanta(self) -> None:
        # Quanta are the weights scaled so that the *heaviest* consumed queue
        # gets one cost unit per visit: shares depend only on the ratios, and
        # no queue fetches a burst of messages in one visit (a burst larger
        # than the queue's credit would be cut short and the queue would lose
        # share).  Lighter queues accumulate credit over several visits.
        # Quanta are rounded to multiples of 2**-20 so that deficits add up
        # exactly in binary floating point (0.1 added ten times is not 1.0).
        names = self._drr.queues
        if not names:
            return
        heaviest = max(self.weight(n) for n in names)
        unit = 1.0 if self.cost == "count" else self.runtime_quantum
        quanta = {n: _dyadic(unit * self.weight(n) / heaviest) for n in names}
        self._drr.set_quanta(quanta)
        self.waiting.set_quanta(quanta)

    # -- fetch decisions ----------------------------------------------------

    def push_windows(self, total: int, cap: int | None = None) -> dict[str, int]:
        """Per-queue prefetch windows for a push transport (AMQP).

        Proportional to the weights, the lightest queue getting
        ``ceil(total / queues)``: when the worker is faster than the broker
        can push, each queue is consumed at window / round trip, so the
        windows alone give the weighted shares; when it is slower, the
        windows keep every queue's buffer stocked and the dispatch order
        decides.  ``cap`` bounds any one window.
        """
        names = self._drr.queues
        if not names:
            return {}
        base = max(2, math.ceil(total / len(names)))
        lightest = min(self.weight(n) for n in names)
        windows = {n: max(1, round(base * self.weight(n) / lightest)) for n in names}
        if cap is not None:
            windows = {n: min(w, cap) for n, w in windows.items()}
        return windows

    def credit(self, queue: str, window: int | None) -> int | None:
        """How many unacknowledged messages ``queue`` may hold before demotion."""
        credits = self._credits(window)
        return None if credits is None else credits.get(queue, max(1, window or 1))

    def _credits(self, window: int | None) -> dict[str, int] | None:
        """Every queue's credit for this window (None: no credit applies)."""
        names = self._drr.queues
        if self.credit_limit is not None:
            return dict.fromkeys(names, self.credit_limit)
        if not window:
            return None
        floor = max(1, window - self.reserve)
        fractions = self._fetch_fractions()
        return {n: max(floor, math.ceil(2.0 * window * fractions[n])) for n in names}

    def _fetch_fractions(self) -> dict[str, float]:
        # Expected fraction of fetches per queue: weight / cost per message.
        rates = {n: self.weight(n) / max(self.fetch_cost(n), 1e-9) for n in self._drr.queues}
        total = sum(rates.values()) or 1.0
        return {n: r / total for n, r in rates.items()}

    def fetch_order(self, window: int | None = None) -> list[str]:
        """The order in which to poll the consumed queues, best first."""
        order = list(self._drr.order())
        self._demoted = set()
        if len(order) < 2 or not window:
            return order
        held, credits = self._held, self._credits(window)
        assert credits is not None
        below: list[str] = []
        above: list[str] = []
        for name in order:
            (below if held[name] < credits[name] else above).append(name)
        self._demoted = set(above)
        return below + above if above else order

    def fetched(self, queue: str, skipped: Sequence[str] = ()) -> None:
        """A message of ``queue`` was fetched; ``skipped`` were polled first.

        The skipped queues were empty when polled: their DRR visit ends, and
        any turn they come to again before ``queue``'s ends too (a queue
        served alone owes nobody: it runs up no debt).
        Queues ahead of ``queue`` that were polled last because they held
        their credit defer their turn, keeping their credit (capped at one
        quantum), so ``queue`` is served in its own turn.  Serving it out of
        turn instead would charge it a debt on every such fetch, and the
        queue after a bursty heavy one would collect those debts faster than
        its visits repay them.  If ``queue`` is still not the head (weights
        changed meanwhile), it is served out of turn and charged as usual.
        """
        drr = self._drr
        for name in skipped:
            drr.pass_over(name)
        demoted, empty = self._demoted, set(skipped)
        passed: set[str] = set()
        head = drr.head()
        while head is not None and head != queue:
            if head in demoted:
                demoted.discard(head)
                drr.defer(head)
            elif head in empty:
                # Found empty by this very poll: DRR would have taken it off
                # the active list, and the round would come back to ``queue``.
                # A second meeting means a whole round found only empty
                # queues: ``queue`` is alone, and what it would owe is
                # forgiven.  Charging it out of turn instead made a queue that
                # ran alone for a while run up an unbounded debt, then starve
                # once the others had work again.
                if head in passed:
                    drr.forgive(queue)
                passed.add(head)
                drr.pass_over(head)
            else:
                break
            head = drr.head()
        if not drr.is_active(queue):
            if self._adopt(queue):
                self._apply_quanta()
            drr.activate(queue)
        estimate = self.fetch_cost(queue)
        drr.served(queue, estimate)
        self._held[queue] += 1
        self._fetched[queue] += 1
        if self.cost == "runtime":
            self._pending.setdefault(queue, deque()).append(estimate)

    def released(self, queue: str) -> None:
        """A held message of ``queue`` was acknowledged, rejected or restored."""
        if self._held.get(queue, 0) > 0:
            self._held[queue] -= 1

    def finished(self, queue: str, runtime: float) -> None:
        """A message of ``queue`` ran for ``runtime`` seconds.

        In runtime mode this post-charges the difference between the
        measured run time and the estimate charged at fetch time.
        """
        if self.cost != "runtime" or queue not in self._held:
            return
        runtime = max(0.0, float(runtime))
        pending = self._pending.get(queue)
        if pending:
            self._drr.charge(queue, runtime - pending.popleft())
        waited = self._wait_pending.get(queue)
        if waited:
            self.waiting.charge(queue, runtime - waited.popleft())
        self._estimates.setdefault(queue, Ewma()).update(runtime)
        self._global_estimate.update(runtime)

    # -- dispatch: tasks waiting for a pool slot ------------------------------

    def wait(self, queue: str, item: object, key: str | None = None) -> None:
        """Buffer a task of ``queue`` until a pool slot is free (``key``: a keyed queue's)."""
        if self._adopt(queue):
            self._apply_quanta()
        self.waiting.put(queue, item, key)

    def next_waiting(self) -> tuple[str, object] | None:
        """The next buffered task in DRR order, charged at dispatch."""
        taken = self.waiting.take(self.fetch_cost)
        if taken is not None and self.cost == "runtime":
            queue = taken[0]
            self._wait_pending.setdefault(queue, deque()).append(self.fetch_cost(queue))
        return taken

    def discarded(self, queue: str) -> None:
        """A fetched message of ``queue`` will not run here: refund its estimate."""
        pending = self._pending.get(queue)
        if self.cost == "runtime" and pending:
            self._drr.charge(queue, -pending.popleft())

    def fetch_cost(self, queue: str) -> float:
        """What a message of ``queue`` is charged when fetched: 1, or its run-time estimate."""
        if self.cost == "count":
            return 1.0
        estimate = self._estimates.get(queue)
        if estimate is not None and estimate.value is not None:
            return estimate.value
        fallback = self._global_estimate.value
        return self.runtime_quantum if fallback is None else fallback

    def reset_held(self) -> None:
        """Forget all held messages (a new channel holds none)."""
        for name in self._held:
            self._held[name] = 0
        self._pending.clear()
        self._wait_pending.clear()

    def held(self, queue: str) -> int:
        return self._held.get(queue, 0)

    # -- introspection ------------------------------------------------------

    def statistics(self, window: int | None = None) -> SchedulerStatistics:
        """A frozen snapshot: weights, held messages, credit and DRR state."""
        names = self._drr.queues
        return SchedulerStatistics(
            cost=self.cost,
            weights={n: self.weight(n) for n in names},
            held={n: self._held.get(n, 0) for n in names},
            credit={n: self.credit(n, window) for n in names},
            cost_estimate={
                n: (e.value if (e := self._estimates.get(n)) is not None else None) for n in names
            },
            fetched={n: self._fetched.get(n, 0) for n in names},
            waiting=self.waiting.counts(),
            drr=self._drr.statistics(),
            dispatch=self.waiting.drr.statistics(),
        )


def _dyadic(value: float) -> float:
    """``value`` rounded to a multiple of 2**-20 (at least 2**-20)."""
    return max(1, round(value * 1048576)) / 1048576
