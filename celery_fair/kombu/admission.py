"""Admission on the producer: refuse publishes before a Redis broker fills.

``celery_fair.install(app)``, for an app with ``fair_broker_memory_high``,
wraps the app's task sender.  Each publish to a queue on Redis is judged by
:func:`~celery_fair.scheduling.admission.backlog_ceiling` on a reading of the
broker that this process keeps and renews every :data:`READ_EVERY` seconds
(:data:`READ_EVERY_NEAR` once memory nears the threshold): one round trip
per renewal, none per publish.  A reading holds the broker's memory
(``INFO memory``) and, from ``high`` on, the backlog of every queue producers
with admission have published to (a set on the broker, :data:`QUEUES`): each
queue's lists and, for a keyed queue, its largest key (``fair.sizes``).

* A plain queue (or a keyed queue's message without a key) at or over the
  ceiling raises :class:`~celery_fair.errors.BrokerMemoryHigh` here.
* A keyed message carries the ceiling to Kombu's ``_put``
  (:data:`~celery_fair.wire.ADMIT_HEADER`), where the push script compares it
  with the key's own backlog, exactly, in the same round trip as the push.

Scoped to Redis: RabbitMQ has its own memory alarm, which blocks publishers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import compat
from ..errors import BrokerMemoryHigh, FairConfigError
from ..keys.publish import names_for, queue_name
from ..keys.store import text
from ..scheduling.admission import AdmissionLimits, BrokerMemory, backlog_ceiling, parse_admission
from ..wire import ADMIT_HEADER, KEY_HEADER, KEYED_HEADER

__all__ = ("READ_EVERY", "READ_EVERY_NEAR", "BrokerGauge", "Reading", "register_app")

logger = logging.getLogger(__name__)

#: Seconds a reading of the broker is used for while memory is well below ``high``.
READ_EVERY = 1.0
#: ... and from :data:`NEAR` of ``high`` on: a flood fills the rest fast.
READ_EVERY_NEAR = 0.1
NEAR = 0.75
#: The return below ``high`` is logged from this fraction of it down.
QUIET = 0.9
#: The set, on the broker (after Kombu's key prefix), of the queues producers
#: with admission have published to: every producer judges by all of them.
QUEUES = "_fair.admission.queues"


@dataclass(frozen=True)
class Reading:
    """The broker as last read: its memory and, from ``high`` on, the backlogs."""

    memory: BrokerMemory
    #: Queue -> messages waiting in its own lists (Kombu's, every priority).
    queues: dict[str, int] = field(default_factory=dict)
    #: The largest backlog of a key or a queue.
    largest: int = 0
    at: float = 0.0


class BrokerGauge:
    """The broker's memory and backlogs, read at most every :data:`READ_EVERY` seconds.

    One per app and process, shared by its threads.  ``clock`` is injected.
    """

    def __init__(
        self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._reading: Reading | None = None
        #: Queues this process published to, and those of them put in QUEUES.
        self._seen: set[str] = set()
        self._registered: set[str] = set()
        self._refusing = False
        self._warned = False  # that nothing can be refused

    def reading(self, channel: Any, queue: str) -> Reading:
        """A reading that includes ``queue``, renewed if it is too old."""
        now = self._clock()
        current = self._reading
        if current is not None and queue in self._seen and now - current.at < self._every(current):
            return current
        with self._lock:
            current = self._reading
            if (
                current is None
                or queue not in self._seen
                or now - current.at >= self._every(current)
            ):
                current = self._read(channel, queue, now)
                self._reading = current
                self._note(current)
            return current

    def _every(self, reading: Reading) -> float:
        fraction = reading.memory.fraction
        return (
            READ_EVERY_NEAR
            if fraction is not None and fraction >= self.limits.high * NEAR
            else READ_EVERY
        )

    def _read(self, channel: Any, queue: str, now: float) -> Reading:
        registry = compat.key_prefix(channel) + QUEUES
        self._seen.add(queue)
        unregistered = sorted(self._seen - self._registered)
        with compat.redis_client(channel) as client:
            pipe = client.pipeline(transaction=False)
            pipe.info("memory")
            if unregistered:
                # Refused under maxmemory: made again at the next reading.
                pipe.sadd(registry, *unregistered)
            pipe.smembers(registry)
            replies = pipe.execute(raise_on_error=False)
            info, members = replies[0], replies[-1]
            if unregistered and not isinstance(replies[1], Exception):
                self._registered.update(unregistered)
            if isinstance(info, Exception):
                if not compat.not_permitted(info):
                    raise info
                # An ACL without INFO (@dangerous): nothing can be judged, nothing refused.
                self._warn_once(
                    "celery-fair: fair_broker_memory_high is set but the broker refuses INFO "
                    "to this user (%s): nothing is refused; allow it with +info",
                    info,
                )
                return Reading(BrokerMemory(0, 0), at=now)
            memory = BrokerMemory.from_info(info)
            fraction = memory.fraction
            if fraction is None or fraction < self.limits.high:
                return Reading(memory, at=now)
            queues = {queue} | (
                set() if isinstance(members, Exception) else {text(m) for m in members}
            )
            return self._backlogs(client, channel, memory, sorted(queues), now)

    def _backlogs(
        self, client: Any, channel: Any, memory: BrokerMemory, queues: Iterable[str], now: float
    ) -> Reading:
        steps, prefix = list(compat.priority_steps(channel)), compat.key_prefix(channel)
        pipe = client.pipeline(transaction=False)
        order = list(queues)
        for name in order:
            for priority in steps:
                pipe.llen(prefix + compat.queue_key(channel, name, priority))
            pipe.zrevrange(names_for(channel, name).sizes, 0, 0, withscores=True)
        replies = iter(pipe.execute())
        sizes: dict[str, int] = {}
        largest = 0
        for name in order:
            sizes[name] = sum(int(next(replies) or 0) for _ in steps)
            top = next(replies)
            largest = max(largest, sizes[name], *(int(score) for _, score in top or ()))
        return Reading(memory, sizes, largest, now)

    def _warn_once(self, message: str, *args: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(message, *args)

    def _note(self, reading: Reading) -> None:
        """Log when refusals start and stop, and a broker without ``maxmemory`` once."""
        memory = reading.memory
        if memory.fraction is None:
            if memory.used:  # (an INFO refused reads as nothing used: said already)
                self._warn_once(
                    "celery-fair: fair_broker_memory_high is set but the broker has no "
                    "maxmemory: nothing is refused (set maxmemory, with the noeviction policy)"
                )
            return
        fraction = memory.used / memory.maxmemory
        refusing = backlog_ceiling(memory, self.limits, reading.largest) is not None
        if refusing != self._refusing and (refusing or fraction < self.limits.high * QUIET):
            # Memory hovers about ``high`` while the flood waits: the return is
            # told only once it has fallen well below.
            self._refusing = refusing
            if refusing:
                logger.warning(
                    "celery-fair: the broker uses %.0f%% of its maxmemory (%d of %d bytes), "
                    "over fair_broker_memory_high=%s: publishes to the largest backlogs "
                    "are refused (the largest has %d messages waiting)",
                    100 * memory.used / memory.maxmemory, memory.used, memory.maxmemory,
                    self.limits.high, reading.largest,
                )  # fmt: skip
            else:
                logger.warning(
                    "celery-fair: the broker uses %.0f%% of its maxmemory, well below "
                    "fair_broker_memory_high=%s: every publish is admitted",
                    100 * fraction, self.limits.high,
                )  # fmt: skip


def register_app(app: Any) -> None:
    """Refuse ``app``'s publishes before its Redis broker fills (``fair_broker_memory_high``).

    An app without the setting is left alone; an invalid one makes every
    send raise the :class:`~celery_fair.errors.FairConfigError`.
    """
    try:
        limits = parse_admission(
            app.conf.get("fair_broker_memory_high"), app.conf.get("fair_broker_memory_hard")
        )
    except FairConfigError as exc:
        compat.wrap_task_sender(app, _refusing(exc), name="admission")
        return
    hook = None if limits is None else admitting_sender(app, BrokerGauge(limits))
    compat.wrap_task_sender(app, hook, name="admission")  # None: an earlier one taken off


def _refusing(error: Exception) -> Callable[..., Any]:
    def send(original: Callable[..., Any], *args: Any, **options: Any) -> Any:
        raise error

    return send


def admitting_sender(app: Any, gauge: BrokerGauge) -> Callable[..., Any]:
    """A hook around ``app.amqp.send_task_message`` that refuses what the broker cannot take."""

    def send(original: Callable[..., Any], producer: Any, name: str, message: Any,
             *args: Any, **options: Any) -> Any:  # fmt: skip
        queue = queue_name(app, options)
        channel = getattr(producer, "channel", None)
        if queue is not None and compat.is_redis_channel(channel):
            admit(gauge, channel, queue, message)
        return original(producer, name, message, *args, **options)

    return send


def admit(gauge: BrokerGauge, channel: Any, queue: str, message: Any) -> None:
    """Refuse ``message`` for ``queue`` (raise), or let it go (a keyed one with its ceiling)."""
    reading = gauge.reading(channel, queue)
    ceiling = backlog_ceiling(reading.memory, gauge.limits, reading.largest)
    if ceiling is None:
        return
    memory = reading.memory
    headers = message[0] if isinstance(message, (tuple, list)) and message else None
    keyed = isinstance(headers, dict) and headers.get(KEYED_HEADER) == queue
    key = headers.get(KEY_HEADER) if keyed and isinstance(headers, dict) else None
    if isinstance(key, str) and key and ceiling > 0:
        # The key's own backlog is compared by the push script, exactly.
        headers[ADMIT_HEADER] = [ceiling, memory.used, memory.maxmemory]  # type: ignore[index]
        return
    backlog = reading.queues.get(queue, 0)
    if ceiling == 0 or backlog >= ceiling:
        raise BrokerMemoryHigh(
            queue, key if isinstance(key, str) else None, backlog, ceiling,
            memory.used, memory.maxmemory,
        )  # fmt: skip
