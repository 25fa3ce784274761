"""The dispatch round: buffered messages leave for the handler in DWRR order.

A :class:`~celery_fair.scheduling.buffer.FairBuffer` (per-queue FIFOs, or
fair key order within a keyed queue) charged by a
:class:`~celery_fair.scheduling.cost.CostModel`: a message is charged its
cost when it is taken and, in runtime mode, the difference to its measured
run time when it finishes (DRR++).  A message taken and then not served
(CoDel sent it back) is refunded: only what runs is charged.

The worker's wait for a pool slot and
:class:`~celery_fair.kombu.FairConsumerMixin`'s buffer are both one of these.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from .buffer import FairBuffer
from .cost import CostModel, PendingCharges
from .drr import DRRStatistics

__all__ = ("DispatchRound",)

T = TypeVar("T")


class DispatchRound(Generic[T]):
    """Messages waiting to be served, taken in DWRR order and charged."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.buffer: FairBuffer[T] = FairBuffer()
        self._pending = PendingCharges()

    def set_quanta(self, quanta: Mapping[str, float]) -> None:
        self.buffer.set_quanta(quanta)

    def put(
        self, queue: str, item: T, key: str | None = None, level: int = 0, user: str | None = None
    ) -> None:
        """Buffer ``item`` of ``queue`` (``key``, ``level``, ``user``: a keyed queue's key,
        level and user within the key)."""
        self.buffer.put(queue, item, key, level, user)

    def take(self) -> tuple[str, T] | None:
        """The next ``(queue, item)`` in DWRR order, charged its cost."""
        taken = self.buffer.take(self.costs.cost)
        if taken is not None and self.costs.runtime:
            self._pending.charged(taken[0], self.costs.cost(taken[0]))
        return taken

    def refund(self, queue: str) -> None:
        """The message of ``queue`` just taken will not be served here."""
        charged = self._pending.settle(queue) if self.costs.runtime else 1.0
        if charged:
            self.buffer.charge(queue, -charged)

    def finished(self, queue: str, runtime: float) -> None:
        """Runtime mode: post-charge the measured run time less the estimate."""
        estimate = self._pending.settle(queue)
        if estimate is not None:
            self.buffer.charge(queue, runtime - estimate)

    def take_key(self, queue: str, key: str) -> list[T]:
        """Remove the buffered messages of ``key`` in keyed ``queue``, oldest first (uncharged)."""
        return self.buffer.take_key(queue, key)

    def clear(self) -> list[T]:
        """Empty the buffer (its messages went back to the broker); return them."""
        return self.buffer.clear()

    def forget_pending(self) -> None:
        """Forget the estimates of messages taken (a new channel: they went back)."""
        self._pending.clear()

    def counts(self) -> dict[str, int]:
        """Buffered messages per queue."""
        return self.buffer.counts()

    def count(self, queue: str) -> int:
        """Buffered messages of ``queue``."""
        return self.buffer.count(queue)

    def statistics(self) -> DRRStatistics:
        return self.buffer.drr.statistics()

    def __len__(self) -> int:
        return len(self.buffer)

    def __bool__(self) -> bool:
        return bool(self.buffer)

    def __iter__(self) -> Iterator[T]:
        return iter(self.buffer)
