"""A Kombu queue cycle (``queue_order_strategy``) driven by the fair scheduler.

Kombu's Redis channel polls its queues with one ``BRPOP key1 key2 ...``; the
server pops from the first non-empty key, so the *order of the keys is the
fetch decision*.  Kombu builds that order from a cycle object with the
protocol of ``kombu.utils.scheduling``: ``update(items)``, ``consume(n)``
and ``rotate(last_used)``.  :class:`DWRRCycle` answers ``consume`` with the
scheduler's DRR order and learns in ``rotate`` which queue was served and
which queues ahead of it were passed over as empty.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from queue import Empty
from typing import Any

from .. import compat
from ..keys.leases import Leases
from ..keys.serving import KeyedServing
from ..scheduling.scheduler import FairScheduler
from .atomic import AtomicFetch, install_atomic_fetch, park_undecodable
from .full import FullBroker

__all__ = ("DWRRCycle", "FairQoS", "connection_errors", "install_on_channel")

logger = logging.getLogger(__name__)


class DWRRCycle:
    """Kombu cycle protocol over a :class:`FairScheduler`.

    ``window`` returns the channel's current prefetch window (for credit).
    A lock guards the scheduler because acknowledgements may come from pool
    threads (``-P threads``) while the consumer thread polls.
    """

    def __init__(
        self,
        scheduler: FairScheduler,
        *,
        window: Callable[[], int | None] = lambda: None,
        lock: threading.RLock | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.window = window
        self.lock = lock or threading.RLock()
        self.items: list[str] = []
        self._sent: list[str] = []
        self.last_fetched: str | None = None
        self.atomic: AtomicFetch | None = None

    def update(self, items: Iterable[str]) -> None:
        """Kombu: the consumed queues changed."""
        self.items = list(items)
        with self.lock:
            self.scheduler.set_queues(self.items)

    def consume(self, n: int) -> list[str]:
        """Kombu: the queues to poll, best first."""
        with self.lock:
            order = self.scheduler.fetch_order(self.window())
        self._sent = order[:n]
        return self._sent

    def run(self, queue: str) -> int:
        """How many messages of ``queue``, first in the last order, one fetch may take."""
        with self.lock:
            return self.scheduler.fetch_run(queue, self.window())

    def rotate(self, last_used: str) -> str:
        """Kombu: a message of ``last_used`` was fetched."""
        if self.items and last_used not in self.items:
            # A fetch sent before the queue's consumer was cancelled: Kombu
            # rejects the message back to Redis (no consumer); the scheduler
            # must not take the queue back in.
            self.last_fetched = None
            return last_used
        sent = self._sent
        try:
            skipped = sent[: sent.index(last_used)]
        except ValueError:
            skipped = []
        with self.lock:
            self.scheduler.fetched(last_used, skipped)
        self.last_fetched = last_used
        return last_used

    def moved_aside(self, queue: str) -> None:
        """A fetched payload of ``queue`` was parked, not delivered: release its slot."""
        with self.lock:
            self.scheduler.released(queue)
        self.last_fetched = None


class _HeldLedger:
    """Maps delivery tags to queues so acks release the right queue's credit."""

    def __init__(self, cycle: DWRRCycle) -> None:
        self.cycle = cycle
        self.tags: dict[Any, str] = {}

    def add(self, tag: Any) -> None:
        queue = self.cycle.last_fetched
        if queue is not None:
            self.tags[tag] = queue
            # The queue name is consumed: a later delivery that does not come
            # through BRPOP (a restored message) must not be misattributed.
            self.cycle.last_fetched = None

    def release(self, tag: Any) -> None:
        queue = self.tags.pop(tag, None)
        if queue is not None:
            with self.cycle.lock:
                self.cycle.scheduler.released(queue)

    def release_all(self) -> None:
        tags, self.tags = self.tags, {}
        with self.cycle.lock:
            for queue in tags.values():
                self.cycle.scheduler.released(queue)


class FairQoS:
    """What celery-fair adds to a virtual channel's QoS, one method per QoS method.

    Installed per instance over Kombu's ``append``, ``ack``, ``reject`` and
    ``restore_unacked`` (:func:`celery_fair.compat.wrap_virtual_qos`), it
    keeps each queue's held count (Kombu keeps the unacknowledged messages in
    one dict without the queue name), frees a limited key's slot when its task
    is settled without running, and keeps a closed channel's acknowledgement
    from stopping the worker (see :func:`install_on_channel`).
    """

    def __init__(
        self,
        channel: Any,
        qos: Any,
        ledger: _HeldLedger,
        *,
        fetch: AtomicFetch | None,
        limited: Leases | None,
        live_channel: Callable[[], Any] | None,
        full: FullBroker | None = None,
    ) -> None:
        self.channel = channel
        self.qos = qos
        self.full = full
        self.ledger = ledger
        self.fetch = fetch
        self.limited = limited
        self.live_channel = live_channel
        self.errors = connection_errors(channel)
        self._append, self._ack, self._reject = qos.append, qos.ack, qos.reject
        self._restore_unacked = getattr(qos, "restore_unacked", None)
        self._recorded_append = compat.unrecorded_append(qos)

    def append(self, message: Any, delivery_tag: Any) -> Any:
        """Kombu: a message was delivered."""
        self.ledger.add(delivery_tag)
        fetch = self.fetch
        if fetch is not None and fetch.recorded == delivery_tag:
            # Already in the unacked hash and index, written by the script.
            return self._recorded_append(message, delivery_tag)
        return self._append(message, delivery_tag)

    def _settle(self, delivery_tag: Any) -> None:
        # Per-key limits: a task acked or rejected without running frees its slot.
        if self.limited is not None:
            self.limited.settled(self.ledger.tags.get(delivery_tag), delivery_tag)
        self.ledger.release(delivery_tag)

    def ack(self, delivery_tag: Any) -> Any:
        """Kombu: acknowledge; through the live channel if this one was closed, outside a
        transaction if the broker is full."""
        self._settle(delivery_tag)
        full = self.full
        try:
            result = self._ack(delivery_tag)
        except self.errors as exc:
            if not channel_closed(self.channel):
                raise
            _ack_elsewhere(self.channel, self.live_channel, delivery_tag, exc)
            return None
        except Exception as exc:
            if full is None or not compat.broker_full(exc):
                raise
            full.acknowledge(self.qos, delivery_tag, exc)
            return None
        if full is not None:
            full.retry()
        return result

    def reject(self, delivery_tag: Any, requeue: bool = False) -> Any:
        """Kombu: reject; on a closed channel the visibility timeout redelivers; a requeue
        a full broker refuses waits in the unacknowledged record."""
        self._settle(delivery_tag)
        try:
            return self._reject(delivery_tag, requeue=requeue)
        except self.errors as exc:
            if not channel_closed(self.channel):
                raise
            logger.warning(
                "celery-fair: reject of %s on a closed channel (%r); the visibility "
                "timeout will redeliver it",
                delivery_tag, exc,
            )  # fmt: skip
            return None
        except Exception as exc:
            if self.full is None or not compat.broker_full(exc):
                raise
            if requeue:
                self.full.requeue_later(self.qos, delivery_tag, exc)
            else:  # Kombu's reject without requeue is its ack: made here already
                self.full.acknowledge(self.qos, delivery_tag, exc)
            return None

    def restore_unacked(self, *args: Any, **kwargs: Any) -> Any:
        """Kombu: the channel closes; its held messages go back to their queues."""
        self.ledger.release_all()
        assert self._restore_unacked is not None
        try:
            return self._restore_unacked(*args, **kwargs)
        except connection_errors(self.channel) as exc:
            # Closing a channel whose connection is already gone (a broker
            # restart): Kombu cannot reach Redis to restore now, and would
            # take the worker down.  The messages stay in Redis's unacked
            # index, and the visibility timeout restores them.
            logger.warning(
                "celery-fair: could not restore unacknowledged messages now (%r); "
                "the visibility timeout will restore them",
                exc,
            )
            return None
        except Exception as exc:
            if self.full is None or not compat.broker_full(exc):
                raise
            self.full.restores_left_to_timeout(exc)  # they stay in the unacked index
            return None


def install_on_channel(
    channel: Any,
    scheduler: FairScheduler,
    *,
    lock: threading.RLock | None = None,
    atomic: bool = False,
    live_channel: Callable[[], Any] | None = None,
    probe: compat.Probe | None = None,
    keyed: KeyedServing | None = None,
    full: FullBroker | None = None,
) -> DWRRCycle | None:
    """Make a polling Kombu channel fetch in DWRR order.

    Returns the installed cycle, or None when the channel has no queue cycle
    (a push transport such as AMQP, which needs per-queue consumers instead).
    The channel's QoS gets a :class:`FairQoS` over its ``append``, ``ack``,
    ``reject`` and ``restore_unacked``, to count each queue's held messages.

    ``atomic`` (Redis) replaces BRPOP with :mod:`celery_fair.kombu.atomic`'s
    fetch script, which writes the unacknowledged record itself: the QoS
    then skips its own write for the messages the script delivered.

    ``live_channel`` returns the consumer's current channel.  A task that
    finishes after a reconnection (late acks) is acknowledged on the channel
    it came from, which is closed: Kombu raises and Celery 5.7's worker stops
    ("Unrecoverable error").  On Redis the unacked hash and index are shared
    by every channel, so the acknowledgement is made through the live one;
    if that fails too, the message stays unacknowledged and the visibility
    timeout redelivers it (a duplicate run, never a loss).

    ``full`` (Redis) settles messages while the broker is at its ``maxmemory``
    instead of stopping the worker (see :mod:`celery_fair.kombu.full`).

    The channel's private parts are probed first (``probe``, see
    :mod:`celery_fair.compat`): without the fetch hooks the atomic fetch
    falls back to Kombu's own BRPOP, still in DWRR order.
    """
    if not compat.is_polling_channel(channel):
        return None
    probe = probe if probe is not None else compat.Probe()
    redis = compat.is_redis_channel(channel)
    if redis:
        compat.probe_redis_channel(channel, probe)
    else:
        compat.probe_virtual_qos(channel.qos, probe)
    qos = channel.qos

    def window() -> int | None:
        return getattr(qos, "prefetch_count", None) or None

    cycle = DWRRCycle(scheduler, window=window, lock=lock)
    compat.set_queue_cycle(channel, cycle)
    cycle.update(getattr(channel, "active_queues", []))

    atomic = atomic and redis and probe.has("kombu.redis.fetch_hooks")
    fetch = install_atomic_fetch(channel, cycle, keyed) if atomic else None
    cycle.atomic = fetch
    fair_qos = FairQoS(
        channel,
        qos,
        _HeldLedger(cycle),
        fetch=fetch,
        limited=keyed.leases if keyed is not None and keyed.limited else None,
        live_channel=live_channel,
        full=full if redis and probe.has("kombu.redis.unacked_indices") else None,
    )
    compat.wrap_virtual_qos(qos, fair_qos)
    if fetch is None and redis and probe.has("kombu.redis.parse_response"):
        guard = _MalformedGuard(channel, cycle)
        if compat.wrap_parse_response(channel.client, guard.remember):
            compat.replace_fetch_read(channel, guard.read)
    return cycle


class _MalformedGuard:
    """Keeps undecodable payloads on Kombu's own BRPOP path instead of crashing the consumer.

    BRPOP removes the item before Kombu decodes it, so a payload that is not
    JSON would be lost and the worker would stop (Kombu 5.7 raises out of its
    event loop).  The raw reply is remembered (one assignment per message, no
    extra parsing), and when decoding fails the item is pushed to
    ``<queue>.fair-malformed``, an error is logged, and polling goes on.
    """

    def __init__(self, channel: Any, cycle: DWRRCycle) -> None:
        self.channel = channel
        self.cycle = cycle
        self.last: Any = None
        self._read = compat.fetch_read(channel)

    def remember(self, command_name: Any, response: Any) -> None:
        """redis-py parsed a reply: keep BRPOP's raw one."""
        if command_name == "BRPOP":
            self.last = response

    def read(self, **options: Any) -> Any:
        """Kombu's BRPOP reply handler, parking what it cannot decode."""
        self.last = None
        try:
            return self._read(**options)
        except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
            response = self.last
            if not response:
                raise
            dest, item = response
            channel = self.channel
            key = dest.decode() if isinstance(dest, bytes) else str(dest)
            queue = key.rsplit(compat.key_separator(channel), 1)[0]
            park_undecodable(channel, self.cycle, queue, item)
            raise Empty() from None


def channel_closed(channel: Any) -> bool:
    """Whether a Kombu virtual channel was closed (by a reconnection)."""
    return bool(getattr(channel, "closed", False)) or getattr(channel, "connection", 1) is None


def _ack_elsewhere(
    channel: Any, live_channel: Callable[[], Any] | None, delivery_tag: Any, exc: Exception
) -> None:
    """Acknowledge through the live channel (Redis: the unacked keys are shared)."""
    live = live_channel() if live_channel is not None else None
    remove = compat.remove_from_unacked(getattr(live, "qos", None))
    if live is not None and live is not channel and remove is not None and not channel_closed(live):
        try:
            remove(delivery_tag).execute()
            logger.info(
                "celery-fair: acknowledged %s through the new channel (its own closed: %r)",
                delivery_tag, exc,
            )  # fmt: skip
            return
        except connection_errors(live) as again:
            exc = again
    logger.warning(
        "celery-fair: could not acknowledge %s (%r); the visibility timeout will "
        "redeliver it",
        delivery_tag, exc,
    )  # fmt: skip


def connection_errors(channel: Any) -> tuple[type[Exception], ...]:
    """Errors of talking to the broker over a connection that is gone."""
    errors = getattr(getattr(channel, "connection", None), "connection_errors", ())
    found = tuple(e for e in errors if isinstance(e, type) and issubclass(e, Exception))
    return (AttributeError, OSError, *found)
