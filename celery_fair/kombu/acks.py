"""Acknowledgement batching of :class:`~celery_fair.kombu.mixin.FairConsumerMixin`.

With ``ack_batch`` above 1, on AMQP, a queue's handled messages are
acknowledged that many at a time by one ``basic.ack`` carrying
``multiple``: fewer frames for the consumer and the broker.  Kombu's
virtual transports (Redis, in memory) ignore ``multiple``, so there every
message is acknowledged when its handler returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kombu.connection import Connection
from kombu.message import Message

__all__ = ("AckBatches",)


class AckBatches:
    """Acknowledges each queue's handled messages up to ``size`` at a time.

    A queue's batch is at most its ``low_water`` mark (half its window), so
    the window keeps refilling while a batch is pending.
    """

    def __init__(self, size: int, low_water: Mapping[str, int], *, log: logging.Logger) -> None:
        self._size = size
        self._low_water = dict(low_water)
        self._log = log
        #: Each queue's batch size on the current connection (none: one by one).
        self._batches: dict[str, int] = {}
        #: Each queue's last handled message not yet acknowledged, with the
        #: count of them.
        self._unacked: dict[str, tuple[Message, int]] = {}

    def start(self, conn: Connection) -> None:
        """Choose the batches for ``conn``: none unless its transport is AMQP."""
        self._batches = {}
        if self._size == 1:
            return
        if conn.transport.driver_type != "amqp":
            self._log.info(
                "FairConsumerMixin option ack_batch=%d: the %r transport ignores basic.ack's "
                "multiple flag, so each message is acknowledged when its handler returns",
                self._size,
                conn.transport.driver_type,
            )
            return
        self._batches = {name: min(self._size, low) for name, low in self._low_water.items()}

    def ack(self, name: str, message: Message) -> None:
        """Acknowledge handled ``message`` of queue ``name``, now or with its batch."""
        # AMQP's basic.ack with multiple acknowledges every delivery on the
        # channel up to this one.  Each queue has a channel of its own and its
        # buffer is FIFO, so every earlier delivery of that channel has been
        # handled, rejected or sent back already: none is acknowledged early.
        batch = self._batches.get(name, 1)
        if batch == 1:
            message.ack()
            return
        _, count = self._unacked.get(name, (message, 0))
        if count + 1 < batch:
            self._unacked[name] = (message, count + 1)
            return
        self._unacked.pop(name, None)
        message.ack(multiple=True)

    def flush(self) -> None:
        """Send every pending batch: before waiting for deliveries, and on stop."""
        while self._unacked:
            _, (message, _count) = self._unacked.popitem()
            message.ack(multiple=True)

    def forget(self) -> None:
        """Drop the pending batches: the broker redelivers their messages."""
        self._unacked.clear()
