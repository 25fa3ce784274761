"""The window fill of :class:`~celery_fair.kombu.mixin.FairConsumerMixin`.

Each consumed queue has a prefetch window and a buffer that never holds
more than it.  :class:`WindowFill` puts deliveries into the buffers and
decides when the consumer looks at its connection again: only when some
buffer is below its low-water mark (half its window), or always while CoDel
is on, whose signal is the sojourn of a full buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from kombu.connection import Connection
from kombu.message import Message

from ..scheduling.dispatch import DispatchRound
from .take import Take

__all__ = ("Buffered", "WindowFill", "split_window")

#: A buffered delivery: ``(body, message, time received)``.
Buffered = tuple[Any, Message, float]


def split_window(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Split ``total`` prefetch slots between queues by weight, at least 1 each.

    A queue served at its share s of the consumer's rate needs a window of
    about s times (refill round trip / service time) plus one to stay
    buffered: a window proportional to the weight.
    """
    weight_sum = sum(weights.values())
    return {name: max(1, round(total * w / weight_sum)) for name, w in weights.items()}


class WindowFill:
    """Fills the per-queue buffers of a consumer from its deliveries and, on Redis, its takes.

    ``buffer`` is the dispatch round the deliveries go to, guarded by
    ``lock`` and stamped with ``clock``; ``windows`` the prefetch window of
    every queue.  ``keep_full``: collect before every choice (CoDel is on).
    ``on_decode_error(message, exc)`` receives a taken message whose body
    cannot be decoded.
    """

    def __init__(
        self,
        buffer: DispatchRound[Buffered],
        lock: AbstractContextManager[Any],
        clock: Callable[[], float],
        windows: Mapping[str, int],
        *,
        keep_full: bool,
        on_decode_error: Callable[[Message, Exception], None],
        accept: Any,
        log: logging.Logger,
    ) -> None:
        self._buffer = buffer
        self._lock = lock
        self._clock = clock
        self._windows = dict(windows)
        #: Below this many buffered messages a queue's window is refilled.
        self.low_water = {name: max(1, size // 2) for name, size in self._windows.items()}
        self._keep_full = keep_full
        self._on_decode_error = on_decode_error
        self._accept = accept
        self._log = log
        #: Some buffer may be below its low-water mark: collect before the
        #: next choice (see :meth:`due`).  Only a take can lower a buffer, so
        #: :meth:`taken` sets it and each :meth:`collect` recomputes it.  Set it
        #: too before waiting: whatever arrives, the rest is collected with it.
        self.short = True
        #: Redis only: each queue's take, and the queues found empty since
        #: their last delivery (not asked again).
        self._takes: list[Take] = []
        self._dry: set[str] = set()

    def start(self, conn: Connection, channels: Mapping[str, Any]) -> None:
        """Consuming begins on ``channels`` (one a queue, by name)."""
        # Redis delivers one message per BRPOP round trip: see _fill.
        redis = conn.transport.driver_type == "redis"
        self._takes = [
            Take(channel, name, self._accept) for name, channel in channels.items() if redis
        ]
        self._dry.clear()

    def stop(self) -> None:
        """Consuming ended: the channels are closing."""
        self._takes.clear()

    def deliver(self, name: str, body: Any, message: Message) -> None:
        """Buffer a delivery of queue ``name`` (a Kombu consumer's callback)."""
        self._dry.discard(name)
        with self._lock:
            self._buffer.put(name, (body, message, self._clock()))

    def taken(self, name: str) -> None:
        """A message of ``name`` left the buffer: mark it short below its low water."""
        if self._buffer.count(name) < self.low_water[name]:
            self.short = True

    def due(self) -> bool:
        """Whether to collect before the next choice."""
        # DWRR's choice changes only when a queue it would serve has nothing
        # buffered, and a look at the connection that finds nothing costs as
        # much as a small handler (a read that times out).  Messages left
        # unread wait in order, the broker's window bounding them.  With CoDel
        # the buffer is kept full: its sojourn times are the signal of a
        # standing queue.  Kept as a flag, not counted per message: counting
        # every buffer cost more per message than the choice itself.
        return self.short or self._keep_full

    def collect(self, conn: Connection) -> None:
        """Take every delivery already readable on ``conn``, without waiting."""
        # Filled first, so that each buffer is as full as its window allows
        # when DWRR chooses: Kombu's poll sends a BRPOP for each channel with
        # room, one message per round trip.  Bounded: no more than the
        # windows' sum can be delivered.
        self._fill()
        for _ in range(sum(self._windows.values()) + 1):
            try:
                conn.drain_events(timeout=0)
            except TimeoutError:  # socket.timeout
                break
        counts = self._buffer.counts()
        self.short = any(counts.get(name, 0) < low for name, low in self.low_water.items())

    def _fill(self) -> None:
        # Kombu's Redis transport has one BRPOP in flight per channel, and its
        # reply is not readable yet when the loop looks without waiting: the
        # drain yields at most one message per queue, and a buffer would never
        # hold more than one (nothing for DWRR to choose between, no sojourn
        # for CoDel).  So, on Redis, each window is filled while the channel's
        # QoS has room (its prefetch count is the window, and CoDel holds it
        # while dropping), as many messages per round trip as it has room for
        # (kombu/take.py).  A queue found empty is not asked again until a
        # delivery (its BRPOP) shows it has work: an empty queue costs no
        # round trip per handled message.
        for take in self._takes:
            name, qos = take.name, take.channel.qos
            if name in self._dry or not qos.can_consume():
                continue
            room = qos.can_consume_max_estimate() or 1
            try:
                messages = take(room)
            except Exception as exc:  # noqa: BLE001 - the next drain sees a lost connection
                self._log.error("cannot read messages of queue %r: %r", name, exc)
                continue
            for message in messages:
                try:
                    body = message.decode()
                except Exception as exc:
                    self._on_decode_error(message, exc)
                    continue
                self.deliver(name, body, message)
            if len(messages) < room:
                self._dry.add(name)  # after the deliveries, which clear it
