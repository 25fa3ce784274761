"""The dispatch round: buffered messages leave for the handler in DWRR order.

A :class:`~celery_fair.scheduling.buffer.FairBuffer` (per-queue FIFOs, or
fair key order within a keyed queue) charged by a
:class:`~celery_fair.scheduling.cost.CostModel`: a message is charged its
cost when it is taken and, in runtime mode, the difference to its measured
run time when it finishes (DRR++).  A message taken and then not served
(CoDel sent it back) is refunded: only what runs is charged.

The worker's wait for a pool slot and
:class:`~celery_fair.kombu.FairConsumerMixin`'s buffer are both one of these,
and both serve it through :func:`next_admitted`: the message DWRR chooses is
shown to the adapter's checks (a paused key, CoDel), and any check may say
:class:`SendBack` instead of letting it be served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .buffer import FairBuffer
from .cost import CostModel, PendingCharges
from .drr import DRRStatistics

__all__ = ("Check", "DispatchRound", "SendBack", "next_admitted")

T = TypeVar("T")


@dataclass(frozen=True)
class SendBack:
    """A check's verdict on a message about to be served: back to the broker instead.

    The one way a check says no (as dramatiq's middleware raises
    ``SkipMessage``); the adapter carries it out with
    :func:`celery_fair.kombu.requeue.requeue`.
    """

    #: What said so: ``codel-requeue``, ``codel-reject``, ``paused``, ``unknown-task``.
    reason: str
    #: The queue the copy goes to (None: the exchange and routing key it came with).
    queue: str | None = None
    #: Headers added to the copy (a return count).
    headers: Mapping[str, Any] = field(default_factory=dict)
    #: Redis: first in line (it keeps its place), else last, as a new publish.
    front: bool = True
    #: No copy: rejected without requeue (RabbitMQ dead-letters it where set up).
    dead_letter: bool = False
    #: A keyed queue's key whose other buffered messages go back with this one.
    key: str | None = None


#: ``check(queue, item, backlog)``: None lets ``item`` be served.
Check = Callable[[str, T, int], SendBack | None]


class DispatchRound(Generic[T]):
    """Messages waiting to be served, taken in DWRR order and charged."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.buffer: FairBuffer[T] = FairBuffer()
        self._pending = PendingCharges()

    def set_quanta(self, quanta: Mapping[str, float]) -> None:
        self.buffer.set_quanta(quanta)

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
        """Buffer ``item`` of ``queue`` (``key``, ``level``, ``user``: a keyed queue's key,
        level and user within the key; ``cost`` and ``user_cost``: what the key's
        turn and the user's turn within it advance by)."""
        self.buffer.put(queue, item, key, level, user, cost, user_cost)

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


def next_admitted(
    round_: DispatchRound[T],
    lock: AbstractContextManager[Any],
    checks: Sequence[Check[T]],
    send_back: Callable[[str, T, SendBack], bool],
    *,
    empty: Callable[[], None] | None = None,
    hold: Callable[[T | None], None] | None = None,
) -> tuple[str, T] | None:
    """The next ``(queue, item)`` in DWRR order that every check lets be served, or None.

    ``checks`` run in their order on each message taken, the first
    :class:`SendBack` wins.  ``send_back(queue, item, verdict)`` carries it
    out: True when the message is no longer here to serve (sent back, or
    buffered again), which refunds its charge (only what runs is charged);
    False serves it here after all (a failed send-back: running a task beats
    losing it).  Then the next message is considered at once (RFC 8289 §5.5:
    drop, then dequeue the next).  ``empty()``: the buffer was found empty
    (CoDel leaves its dropping state).  ``hold(item)``: the message in hand,
    set under the lock as it is taken, None once it is sent back.  The checks
    and the send-back run outside the lock: they may publish.
    """
    while True:
        with lock:
            taken = round_.take()
            backlog = len(round_)
            if taken is not None and hold is not None:
                hold(taken[1])
        if taken is None:
            if empty is not None:
                empty()
            return None
        queue, item = taken
        verdict = None
        for check in checks:
            verdict = check(queue, item, backlog)
            if verdict is not None:
                break
        if verdict is None or not send_back(queue, item, verdict):
            return taken
        with lock:
            round_.refund(queue)
        if hold is not None:
            hold(None)
