"""The fetch round: in which order a worker polls its queues, and per-queue credit.

The design's one law: in steady state a queue is consumed exactly as fast
as it is fetched, so a weight that acts only on the worker's buffer does
nothing.  A polling transport asks :meth:`FetchRound.order` for the order
in which to poll the consumed queues and reports what it got with
:meth:`FetchRound.fetched`.  Queues that are not the first in the order and
yet were passed over by the broker were empty (or held back by credit):
their visit ends, as DRR prescribes for an empty queue.

Credit: a queue that holds ``credit`` or more unacknowledged messages moves
to the *end* of the poll order, behind every queue that is below its credit,
so one busy queue cannot keep the others out of the prefetch window.  It is
demoted, not excluded: a BRPOP that leaves a backlogged queue out would block
until its timeout even after that queue became eligible again, idling the
worker.  A queue's credit is ``window - reserve`` (room kept for the others)
or twice its expected share of the fetches times the window, whichever is
larger, so credit never binds on a queue that is only taking its fair share
(in runtime mode, a queue of short tasks takes most of the fetches).

A push transport (AMQP) has no poll order: :meth:`FetchRound.push_windows`
sizes each queue's prefetch window instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from .cost import CostModel, PendingCharges
from .drr import DeficitRoundRobin, DRRStatistics

__all__ = ("WINDOW_CAP_FLOOR", "FetchRound", "window_cap")

#: The least a queue's push window may be capped at.  The cap (four times
#: Celery's window) keeps one heavy queue from pulling a whole backlog into a
#: worker's memory; with a small Celery window (one task: a prefetch multiplier
#: of 1 and one process) it would cut the heavier queues' windows and flatten
#: the weights, which with late acks are then the only thing making the shares.
WINDOW_CAP_FLOOR = 64


def window_cap(total: int) -> int:
    """The largest push window of one queue for Celery's window of ``total`` tasks."""
    return max(4 * total, WINDOW_CAP_FLOOR)


class FetchRound:
    """DWRR over the consumed queues, applied where messages are fetched.

    ``weight(queue)`` gives a queue's weight, ``costs`` what a message
    costs.  ``credit`` is a fixed per-queue limit of held messages, or None
    to derive it from the prefetch window as ``window - reserve``.
    ``on_new_queue()`` is called when a fetch brings a queue the round did
    not know (its quantum must be set before it is charged).
    """

    def __init__(
        self,
        weight: Callable[[str], float],
        costs: CostModel,
        *,
        credit: int | None = None,
        reserve: int = 1,
        on_new_queue: Callable[[], None] = lambda: None,
    ) -> None:
        self.weight = weight
        self.costs = costs
        self.on_new_queue = on_new_queue
        self.credit_limit = credit
        self.reserve = max(0, int(reserve))
        self.drr = DeficitRoundRobin()
        self._held: dict[str, int] = {}
        self._fetched: dict[str, int] = {}
        self._pending = PendingCharges()
        #: Queues the last poll order put last for holding their credit.
        self._demoted: set[str] = set()
        #: Tasks of a queue that may run at once here (``fair_queue_concurrency``):
        #: its credit is at most the window's share of them, so a queue at its
        #: limit is polled last and the others fill the window.
        self.limits: dict[str, int] = {}

    @property
    def queues(self) -> tuple[str, ...]:
        return self.drr.queues

    def adopt(self, queue: str) -> bool:
        """Start tracking ``queue``; True if it is new (its quantum must be set)."""
        self._held.setdefault(queue, 0)
        self._fetched.setdefault(queue, 0)
        if queue in self.drr:
            return False
        self.drr.add(queue)
        return True

    def remove(self, queue: str) -> None:
        self.drr.remove(queue)

    # -- push transports ---------------------------------------------------

    def push_windows(self, total: int, cap: int | None = None) -> dict[str, int]:
        """Per-queue prefetch windows for a push transport (AMQP).

        Proportional to the weights, the lightest queue getting
        ``ceil(total / queues)``: when the worker is faster than the broker
        can push, each queue is consumed at window / round trip, so the
        windows alone give the weighted shares; when it is slower, the
        windows keep every queue's buffer stocked and the dispatch order
        decides.  ``cap`` bounds any one window.
        """
        names = self.drr.queues
        if not names:
            return {}
        base = max(2, math.ceil(total / len(names)))
        lightest = min(self.weight(n) for n in names)
        windows = {n: max(1, round(base * self.weight(n) / lightest)) for n in names}
        if cap is not None:
            windows = {n: min(w, cap) for n, w in windows.items()}
        return windows

    # -- credit --------------------------------------------------------------

    def credit(self, queue: str, window: int | None) -> int | None:
        """How many unacknowledged messages ``queue`` may hold before demotion."""
        credits = self._credits(window)
        return None if credits is None else credits.get(queue, max(1, window or 1))

    def _credits(self, window: int | None) -> dict[str, int] | None:
        """Every queue's credit for this window (None: no credit applies)."""
        names = self.drr.queues
        if self.credit_limit is not None:
            credits = dict.fromkeys(names, self.credit_limit)
        elif not window:
            return None
        else:
            floor = max(1, window - self.reserve)
            fractions = self._fetch_fractions()
            credits = {n: max(floor, math.ceil(2.0 * window * fractions[n])) for n in names}
        if self.limits and window:
            # The window holds this many tasks per pool slot (Celery's multiplier).
            per_slot = window / max(1, self.reserve)
            for name, limit in self.limits.items():
                if name in credits:
                    credits[name] = min(credits[name], max(1, math.ceil(limit * per_slot)))
        return credits

    def _fetch_fractions(self) -> dict[str, float]:
        # Expected fraction of fetches per queue: weight / cost per message.
        cost = self.costs.cost
        rates = {n: self.weight(n) / max(cost(n), 1e-9) for n in self.drr.queues}
        total = sum(rates.values()) or 1.0
        return {n: r / total for n, r in rates.items()}

    # -- poll order and what it fetched --------------------------------------

    def order(self, window: int | None = None) -> list[str]:
        """The order in which to poll the consumed queues, best first."""
        order = list(self.drr.order())
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

    def run(self, queue: str, window: int | None = None) -> int:
        """How many messages of ``queue`` one fetch may take in a row (at least 1).

        A batch keeps the order DRR would follow one fetch at a time: the head
        is served while its deficit lasts, so it may take as many messages as
        its deficit pays for, and no more than its credit leaves room for.  A
        queue that is not the head takes one.  A worker that consumes one queue
        owes no other: only the credit bounds its run.

        Costs post-charged (``fair_cost`` other than ``"count"``) take one: the
        deficits, and a keyed queue's tags on the broker, are corrected after
        the tasks ran, by the charges later fetches carry, and a batch would be
        taken in the order of values not corrected yet (two workers of
        different sizes drifted to 0.9 of DRF's dominant shares).
        """
        drr = self.drr
        if self.costs.runtime or drr.head() != queue:
            return 1
        n: float = math.inf
        if len(drr.queues) > 1:
            cost = self.costs.cost(queue)
            if cost > 0:
                n = math.ceil(drr.deficit(queue) / cost)
        credits = self._credits(window)
        if credits is not None:
            n = min(n, credits.get(queue, 1) - self._held.get(queue, 0))
        return max(1, int(min(n, 2**31)))

    def fetched(self, queue: str, skipped: Sequence[str] = ()) -> None:
        """A message of ``queue`` was fetched; ``skipped`` were polled first.

        The message is charged its cost (its estimate in runtime mode).
        The skipped queues were empty when polled: their DRR visit ends,
        and any turn they come to again before ``queue``'s ends too (a
        queue served alone owes nobody: it runs up no debt).
        Queues ahead of ``queue`` that were polled last because they held
        their credit defer their turn, keeping their credit (capped at one
        quantum), so ``queue`` is served in its own turn.  Serving it out of
        turn instead would charge it a debt on every such fetch, and the
        queue after a bursty heavy one would collect those debts faster than
        its visits repay them.  If ``queue`` is still not the head (weights
        changed meanwhile), it is served out of turn and charged as usual.
        """
        drr = self.drr
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
            if self.adopt(queue):
                self.on_new_queue()
            drr.activate(queue)
        estimate = self.costs.cost(queue)
        self.drr.served(queue, estimate)
        self._held[queue] += 1
        self._fetched[queue] += 1
        if self.costs.runtime:
            self._pending.charged(queue, estimate)

    def released(self, queue: str) -> None:
        """A held message of ``queue`` was acknowledged, rejected or restored."""
        if self._held.get(queue, 0) > 0:
            self._held[queue] -= 1

    def finished(self, queue: str, runtime: float) -> None:
        """Runtime mode: post-charge the measured run time less the estimate."""
        estimate = self._pending.settle(queue)
        if estimate is not None:
            self.drr.charge(queue, runtime - estimate)

    def discarded(self, queue: str) -> None:
        """A fetched message of ``queue`` will not run here: refund its estimate."""
        estimate = self._pending.settle(queue) if self.costs.runtime else None
        if estimate is not None:
            self.drr.charge(queue, -estimate)

    def tracks(self, queue: str) -> bool:
        return queue in self._held

    def held(self, queue: str) -> int:
        return self._held.get(queue, 0)

    def reset_held(self) -> None:
        """Forget all held messages (a new channel holds none)."""
        for name in self._held:
            self._held[name] = 0
        self._pending.clear()

    def held_counts(self) -> Mapping[str, int]:
        return {n: self._held.get(n, 0) for n in self.drr.queues}

    def fetched_counts(self) -> Mapping[str, int]:
        return {n: self._fetched.get(n, 0) for n in self.drr.queues}

    def statistics(self) -> DRRStatistics:
        return self.drr.statistics()
