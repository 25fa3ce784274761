"""``fair_prefetch="auto"`` on a push transport (AMQP): windows that follow the load.

RabbitMQ applies a per-consumer ``basic.qos(prefetch, global=False)`` only to
consumers created after it, so a live consumer's window cannot be changed in
place.  Two mechanisms could move it without reconnecting:

* a channel-wide limit (``basic.qos(prefetch, global=True)``) applies at once,
  but only caps the *sum*: when it binds, the broker, not the weights, decides
  which queue refills the freed slot, and the shares flatten.  Quorum queues
  do not support it at all, and RabbitMQ 4 deprecates it;
* re-consuming: ``basic.cancel`` + ``basic.qos(new, global=False)`` +
  ``basic.consume`` on the same channel.  The messages already delivered stay
  unacknowledged *on the channel* (cancelling a consumer returns nothing to
  the queue), so they are acked as usual and nothing is lost or redelivered.

:class:`PushWindows` re-consumes: it keeps the per-queue proportions, works
on every queue type and is plain AMQP 0-9-1.  Only the queues whose window
changed are re-consumed, at most once per ``min_gap`` seconds.  The old
consumer's unacknowledged messages no longer count against the new window,
so right after a shrink the worker holds the old messages plus at most the
new window; the broker sends nothing more until they are worked off.

The round trip that sizes the window is the *refill* latency: after an ack
frees a slot of a full window, the broker can send the next message only once
the ack has reached it, so the time from that ack to the consumer's next
delivery is at least one round trip (more when the queue was empty, hence the
minimum over recent samples, see :class:`AdaptivePrefetch`).  The duration of
the synchronous ``basic.qos`` issued before each ``basic.consume`` seeds the
estimate before any window has filled.

Every AMQP call is made on the consumer's thread (the channel is not thread
safe): a resize decided on another thread (a thread pool's completion
callback) is applied at the consumer's next delivery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import compat
from ..scheduling.prefetch import AdaptivePrefetch

__all__ = ("PushWindows", "PushWindowsStatistics")


@dataclass(frozen=True)
class PushWindowsStatistics:
    """A snapshot of a :class:`PushWindows` (``fair_stats`` -> ``adaptive_prefetch``)."""

    reconsumes: int
    round_trip_samples: int
    #: Unacknowledged messages per consumer tag (those holding any).
    unacked_by_consumer: Mapping[str, int]


class PushWindows:
    """Adaptive per-queue prefetch windows on one AMQP channel.

    ``windows`` is the worker's dict of per-queue windows, changed in place;
    ``split(total)`` turns the adaptive total into per-queue windows (the
    scheduler's weighted split).  ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        adaptive: AdaptivePrefetch,
        windows: dict[str, int],
        split: Callable[[int], dict[str, int]],
        *,
        clock: Callable[[], float],
        min_gap: float = 1.0,
    ) -> None:
        self.adaptive = adaptive
        self.windows = windows
        self.split = split
        self.clock = clock
        self.min_gap = min_gap
        self.reconsumes = 0
        self.round_trip_samples = 0
        self._lock = threading.Lock()
        self._limit: dict[str, int] = {}  # consumer tag -> its window
        self._inflight: dict[str, int] = {}  # consumer tag -> unacknowledged
        self._tag_of: dict[Any, str] = {}  # delivery tag -> consumer tag
        self._freed_at: dict[str, float] = {}  # consumer tag -> ack that freed a full window
        self._tag_for_queue: dict[str, str] = {}  # queue -> its live consumer tag
        self._pending: dict[str, int] | None = None
        self._last_change = -float("inf")
        self._applying = False
        self._consumer: Any = None
        self._thread: int | None = None

    # -- wiring -----------------------------------------------------------

    def attach(self, channel: Any, task_consumer: Any) -> None:
        """Follow acknowledgements on ``channel``; re-consume via ``task_consumer``."""
        self._consumer = task_consumer
        self._thread = threading.get_ident()
        compat.follow_settlements(channel, self.settled)

    def consuming(
        self, queue: str, kwargs: dict[str, Any], window: int, qos_seconds: float
    ) -> None:
        """A ``basic.consume`` of ``queue`` with ``window`` is about to be sent with ``kwargs``.

        ``qos_seconds`` is how long its synchronous ``basic.qos`` took: a round
        trip to the broker.  The delivery callback is wrapped to count.
        """
        self.adaptive.observe_fetch(qos_seconds)
        tag = kwargs.get("consumer_tag")
        callback = kwargs.get("callback")
        if not tag or callback is None:
            return
        with self._lock:
            old = self._tag_for_queue.get(queue)
            if old is not None and old != tag:
                # The cancelled consumer's messages are still acked, but no
                # more come: its window no longer says anything.
                self._limit.pop(old, None)
                self._freed_at.pop(old, None)
            self._tag_for_queue[queue] = tag
            self._limit[tag] = window
            self._inflight.setdefault(tag, 0)

        def fair_delivery(message: Any) -> Any:
            self.delivered(tag, getattr(message, "delivery_tag", None))
            result = callback(message)
            if self._pending is not None:
                self.apply()
            return result

        kwargs["callback"] = fair_delivery

    # -- accounting -------------------------------------------------------

    def delivered(self, consumer_tag: str, delivery_tag: Any) -> None:
        """One message arrived for ``consumer_tag``."""
        now = self.clock()
        with self._lock:
            self._tag_of[delivery_tag] = consumer_tag
            self._inflight[consumer_tag] = self._inflight.get(consumer_tag, 0) + 1
            freed = self._freed_at.pop(consumer_tag, None)
        if freed is not None:
            self.round_trip_samples += 1
            self.adaptive.observe_fetch(now - freed)

    def settled(self, delivery_tag: Any) -> None:
        """A message was acked or rejected (its slot returns to its consumer)."""
        now = self.clock()
        with self._lock:
            tag = self._tag_of.pop(delivery_tag, None)
            if tag is None:
                return
            held = self._inflight.get(tag, 0)
            if tag in self._limit and held >= self._limit[tag]:
                # The window was full: the broker sends the next message
                # only once this ack reached it.
                self._freed_at.setdefault(tag, now)
            if held <= 1 and tag not in self._limit:
                self._inflight.pop(tag, None)  # a cancelled consumer, worked off
            else:
                self._inflight[tag] = max(0, held - 1)

    # -- resizing ---------------------------------------------------------

    def resize(self, total: int) -> None:
        """The adaptive total is ``total``: re-consume the queues whose window changes."""
        wanted = self.split(total)
        now = self.clock()
        with self._lock:
            if all(self.windows.get(q) == w for q, w in wanted.items()):
                self._pending = None
                return
            if now - self._last_change < self.min_gap:
                return  # asked again at the next task's completion
            self._pending = wanted
        if threading.get_ident() == self._thread:
            self.apply()

    def apply(self) -> None:
        """Re-consume the queues whose window changed (on the consumer's thread)."""
        if self._applying or threading.get_ident() != self._thread:
            return
        with self._lock:
            wanted, self._pending = self._pending, None
        consumer = self._consumer
        if wanted is None or consumer is None:
            return
        self._applying = True
        try:
            changed = [
                q for q in list(consumer.queues) if wanted.get(q.name, self.windows.get(q.name))
                != self.windows.get(q.name)
            ]  # fmt: skip
            if not changed:
                return
            self.windows.update({q.name: wanted[q.name] for q in changed})
            self._last_change = self.clock()
            for queue in changed:
                # basic.cancel: deliveries stop; the messages already
                # delivered stay unacknowledged on the channel.
                consumer.cancel_by_queue(queue.name)
            for queue in changed:
                consumer.add_queue(queue)
            # basic.qos(new window, global=False) + basic.consume per queue
            # (the worker's basic_consume wrapper issues the qos).
            consumer.consume()
            self.reconsumes += 1
        finally:
            self._applying = False

    def statistics(self) -> PushWindowsStatistics:
        """A frozen snapshot: re-consumes, round-trip samples, unacked per consumer."""
        with self._lock:
            return PushWindowsStatistics(
                reconsumes=self.reconsumes,
                round_trip_samples=self.round_trip_samples,
                unacked_by_consumer={t: n for t, n in self._inflight.items() if n},
            )
