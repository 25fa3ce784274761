"""What a message costs: the cost modes, quanta from weights, run-time estimates.

In ``"count"`` mode every message costs one unit.  In ``"runtime"`` mode a
message is charged an estimate of its run time when it is chosen (its
queue's moving average) and the difference to the measured run time when
it finishes: DRR++ post-charge (RFC 8290 §4.2), so that the sum charged per
queue is exactly the measured run time once its messages have finished.
``"dominant"`` mode is post-charged the same way, with the task's dominant
share of the worker's capacity (:mod:`.resources`) in place of its run time:
Dominant Resource Fairness between queues and keys.
:class:`PendingCharges` remembers the estimates charged and not yet settled.

Shared by the worker's fetch and dispatch rounds and by
:class:`~celery_fair.kombu.FairConsumerMixin`.  Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Literal

from .drr import check_quantum
from .estimate import Ewma

__all__ = (
    "COST_MODES",
    "MEASURED_COST_MODES",
    "CostMode",
    "CostModel",
    "PendingCharges",
    "dyadic",
    "quanta",
)

CostMode = Literal["count", "runtime", "dominant"]
COST_MODES: tuple[str, ...] = ("count", "runtime", "dominant")
#: The modes of a consumer that knows no resources (:class:`~celery_fair.kombu.FairConsumerMixin`).
MEASURED_COST_MODES: tuple[str, ...] = ("count", "runtime")


def dyadic(value: float) -> float:
    """``value`` rounded to a multiple of 2**-20 (at least 2**-20)."""
    return max(1, round(value * 1048576)) / 1048576


def quanta(weights: Mapping[str, float], unit: float) -> dict[str, float]:
    """DRR quanta for these weights: the heaviest queue gets ``unit`` per visit.

    Shares depend only on the ratios, and no queue is served a burst of
    messages in one visit (a burst larger than a queue's credit or buffer
    would be cut short and the queue would lose share); lighter queues
    accumulate credit over several visits.  Quanta are rounded to multiples
    of 2**-20 so that deficits add up exactly in binary floating point (0.1
    added ten times is not 1.0).
    """
    if not weights:
        return {}
    heaviest = max(weights.values())
    return {name: dyadic(unit * w / heaviest) for name, w in weights.items()}


class CostModel:
    """The cost of a message of each queue: 1, or an estimate of what it will be charged.

    ``runtime_quantum`` (seconds) is the cost unit in runtime mode, and the
    estimate of a queue before any of its messages has finished (when no
    other queue's has either).  In dominant mode the unit is one pool slot's
    share of the worker (a task that declares nothing costs 1).
    """

    def __init__(self, cost: CostMode = "count", *, runtime_quantum: float = 0.001) -> None:
        if cost not in COST_MODES:
            raise ValueError(f"cost={cost!r}: must be one of {COST_MODES}")
        self.mode: CostMode = cost
        self.runtime_quantum = check_quantum("<runtime quantum>", runtime_quantum)
        self._estimates: dict[str, Ewma] = {}
        self._global = Ewma()

    @property
    def runtime(self) -> bool:
        """Whether costs are measured per task and post-charged (run times, or dominant
        shares), not counts."""
        return self.mode != "count"

    @property
    def unit(self) -> float:
        """The cost the heaviest queue is given per DRR visit."""
        return self.runtime_quantum if self.mode == "runtime" else 1.0

    def quanta(self, weights: Mapping[str, float]) -> dict[str, float]:
        """DRR quanta for ``weights`` in this cost unit (see :func:`quanta`)."""
        return quanta(weights, self.unit)

    def cost(self, queue: str) -> float:
        """What a message of ``queue`` is charged when chosen."""
        if self.mode == "count":
            return 1.0
        estimate = self._estimates.get(queue)
        if estimate is not None and estimate.value is not None:
            return estimate.value
        fallback = self._global.value
        return self.unit if fallback is None else fallback

    def observe(self, queue: str, runtime: float) -> None:
        """A message of ``queue`` ran for ``runtime`` seconds."""
        self._estimates.setdefault(queue, Ewma()).update(runtime)
        self._global.update(runtime)

    def estimates(self, queues: Iterable[str]) -> dict[str, float | None]:
        """Each queue's run-time estimate (None: nothing measured yet)."""
        return {q: (e.value if (e := self._estimates.get(q)) is not None else None) for q in queues}


class PendingCharges:
    """Estimates charged per queue and not yet settled, oldest first."""

    def __init__(self) -> None:
        self._pending: dict[str, deque[float]] = {}

    def charged(self, queue: str, estimate: float) -> None:
        self._pending.setdefault(queue, deque()).append(estimate)

    def settle(self, queue: str) -> float | None:
        """The oldest estimate of ``queue`` (None: none pending), now settled."""
        pending = self._pending.get(queue)
        return pending.popleft() if pending else None

    def clear(self) -> None:
        self._pending.clear()
