"""A Redis at its ``maxmemory``: the worker settles what it holds instead of stopping.

With ``maxmemory`` and the ``noeviction`` policy (what Celery's docs and managed
Redis services expect of a broker), a full Redis refuses every command that
may grow memory, and every command queued inside ``MULTI`` (Redis's
``processCommand``: a transaction's queue may grow without bound).  Kombu
acknowledges a message by removing its unacknowledged record (``ZREM`` and
``HDEL``) in ``MULTI``/``EXEC``: refused, the error leaves Kombu's event loop
and the worker exits, so the one thing that frees memory, running the
backlog, stops for every tenant.  ``ZREM`` and ``HDEL`` alone only free
memory and Redis runs them when full: :class:`FullBroker` is what the
worker's QoS (:class:`~celery_fair.kombu.cycle.FairQoS`) falls back on.

* an acknowledgement (or a reject without requeue) removes the record
  outside a transaction;
* a requeue cannot be done (``LPUSH`` grows memory): the message stays in the
  unacknowledged record, where nothing loses it, and is put back when Redis
  accepts it again: tried at the following settlements, backing off from
  :data:`RETRY_FIRST` to :data:`RETRY_MAX` seconds (and in any case the
  visibility timeout restores it);
* each kind is logged once (WARNING) and counted (``inspect fair_stats``
  ``broker_full``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from .. import compat

__all__ = ("RETRY_FIRST", "RETRY_MAX", "FullBroker", "FullBrokerStatistics")

logger = logging.getLogger(__name__)

#: Seconds before a requeue refused by a full broker is tried again, doubling up to RETRY_MAX.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0


@dataclass(frozen=True)
class FullBrokerStatistics:
    """What a worker did because its broker was full."""

    #: Acknowledgements (and rejects without requeue) made outside a transaction.
    acks: int
    #: Requeues the broker refused, and how many of them were put back later.
    requeues_refused: int
    requeued_later: int
    #: Refused requeues still waiting in the unacknowledged record.
    requeues_waiting: int
    #: Channel closes whose held messages were left to the visibility timeout.
    restores_left: int
    #: Rounds of Kombu's restore of messages past their visibility timeout skipped.
    restores_skipped: int
    #: Queue lengths read outside a transaction (queues declared while full).
    sizes_outside: int = 0
    #: Queue bindings the broker refused (remote control, events).
    bindings_refused: int = 0
    #: Keyed queues' settings the broker refused at start.
    settings_refused: int = 0
    #: Refused writes (bindings, settings) still to make.
    writes_waiting: int = 0
    #: Rounds of Kombu's refresh of expiring bindings skipped (Kombu releases with them).
    refreshes_skipped: int = 0


class FullBroker:
    """One worker's fallbacks for a full Redis, shared by its channels."""

    def __init__(self, clock: Callable[[], float] = monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        #: What was done instead, by the statistics field that counts it.
        self._counts: dict[str, int] = {}
        #: Requeues to try again: (the QoS, the delivery tag).
        self._waiting: list[tuple[Any, Any]] = []
        #: Writes to make again when the broker accepts them (bindings, settings).
        self._writes: list[Callable[[], Any]] = []
        self._next_try = 0.0
        self._backoff = RETRY_FIRST

    def acknowledge(self, qos: Any, delivery_tag: Any, exc: Exception) -> None:
        """The acknowledgement of ``delivery_tag`` was refused: remove its record outside
        a transaction, and forget the message in memory."""
        compat.remove_unacked_outside_transaction(qos, delivery_tag)
        compat.forget_delivered(qos, delivery_tag)
        self._note("acks", "acknowledgements are made outside a transaction", exc)

    def requeue_later(self, qos: Any, delivery_tag: Any, exc: Exception) -> None:
        """The requeue of ``delivery_tag`` was refused: it stays in the unacknowledged
        record (nothing is lost) and is put back when the broker accepts it."""
        compat.forget_delivered(qos, delivery_tag)
        with self._lock:
            if not self._waiting:
                self._next_try = self.clock() + self._backoff
            self._waiting.append((qos, delivery_tag))
        self._note(
            "requeues_refused",
            "messages sent back stay in the unacknowledged record and are put back when it "
            "accepts them (or by the visibility timeout)",
            exc,
        )

    def restores_left_to_timeout(self, exc: Exception) -> None:
        """A channel closed and could not put its held messages back."""
        self._note(
            "restores_left",
            "a closing channel's messages stay in the unacknowledged record for the "
            "visibility timeout",
            exc,
        )

    def restore_skipped(self, exc: Exception) -> None:
        """Kombu's round of restoring messages past their visibility timeout was refused."""
        self._note(
            "restores_skipped",
            "restoring messages past their visibility timeout waits for the next poll",
            exc,
        )

    def size_outside(self, exc: Exception) -> None:
        """A queue's length was refused in a transaction and read outside one."""
        self._note("sizes_outside", "queue lengths are read outside a transaction", exc)

    def refresh_skipped(self, exc: Exception) -> None:
        """Kombu's refresh of expiring queue bindings was refused."""
        self._note("refreshes_skipped", "refreshing queue bindings waits for the next try", exc)

    def bind_later(self, channel: Any, args: tuple[Any, ...], exc: Exception) -> None:
        """A queue binding was refused: make it when the broker accepts it."""
        self.later(
            "bindings_refused",
            "new queue bindings (remote control, events) are made when it accepts them",
            lambda: compat.bind_queue_again(channel, args),
            exc,
        )

    def later(self, counter: str, instead: str, write: Callable[[], Any], exc: Exception) -> None:
        """A write the broker refused (``exc``): ``write()`` again when it accepts writes.

        Tried at settlements with the requeues' back-off; dropped if it fails for
        another reason than a full broker (its channel closed, its queue gone).
        """
        with self._lock:
            if not self._waiting and not self._writes:
                self._next_try = self.clock() + self._backoff
            self._writes.append(write)
        self._note(counter, instead, exc)

    def retry(self) -> None:
        """Put back the refused requeues and make the refused bindings, if it is time
        to try again (at a settlement)."""
        if not (self._waiting or self._writes) or self.clock() < self._next_try:
            return
        with self._lock:
            waiting, self._waiting = self._waiting, []
            writes, self._writes = self._writes, []
        kept = []
        for write in writes:
            try:
                write()
            except Exception as exc:  # noqa: BLE001 - kept while the broker is full
                if compat.broker_full(exc):
                    kept.append(write)
                else:  # a channel closed since: what it wrote for went with it
                    logger.debug("celery-fair: a refused write is dropped (%r)", exc)
        with self._lock:
            self._writes = kept + self._writes
        left = []
        for qos, tag in waiting:
            try:
                compat.restore_unacked_message(qos, tag)
            except Exception as exc:  # noqa: BLE001 - kept and tried again, never lost
                if not compat.broker_full(exc) and not isinstance(exc, OSError):
                    logger.warning("celery-fair: could not requeue %s now (%r)", tag, exc)
                left.append((qos, tag))
        with self._lock:
            self._counts["requeued_later"] = (
                self._counts.get("requeued_later", 0) + len(waiting) - len(left)
            )
            self._waiting = left + self._waiting
            if left or kept:
                self._backoff = min(self._backoff * 2, RETRY_MAX)
            else:
                self._backoff = RETRY_FIRST
            self._next_try = self.clock() + self._backoff

    def _note(self, counter: str, instead: str, exc: Exception) -> None:
        """Count one more of ``counter``; the first time, say what is done instead."""
        with self._lock:
            first = counter not in self._counts
            self._counts[counter] = self._counts.get(counter, 0) + 1
        if not first:
            return
        logger.warning(
            "celery-fair: the broker is full (%s): %s; the worker goes on draining its backlog",
            exc, instead,
        )  # fmt: skip

    def statistics(self) -> FullBrokerStatistics:
        with self._lock:
            counts = self._counts
            return FullBrokerStatistics(
                acks=counts.get("acks", 0),
                requeues_refused=counts.get("requeues_refused", 0),
                requeued_later=counts.get("requeued_later", 0),
                requeues_waiting=len(self._waiting),
                restores_left=counts.get("restores_left", 0),
                restores_skipped=counts.get("restores_skipped", 0),
                sizes_outside=counts.get("sizes_outside", 0),
                bindings_refused=counts.get("bindings_refused", 0),
                writes_waiting=len(self._writes),
                refreshes_skipped=counts.get("refreshes_skipped", 0),
                settings_refused=counts.get("settings_refused", 0),
            )
