"""Bad input on a fair worker: parked or sent back, never dropped.

Plain Celery loses two kinds of input (``celery.worker.consumer.Consumer``):
a message whose body does not decode is acknowledged (``on_decode_error``),
and a task name this worker does not know is rejected (``on_unknown_task``),
which on Redis, or RabbitMQ without a dead-letter exchange, drops it.  In a
rolling deploy the second one loses real work: producers already send the new
task while old workers still consume its queue.

Here:

- a body that does not decode, a content type the worker does not accept, a
  message that is not a task at all: *parked* with the reason and the time
  (:mod:`celery_fair.parking`), one log line naming the queue and the reason;
- an unknown task name: kept for ``fair_unknown_task_delay`` seconds, then
  sent back to its queue (to the back of the line) with the header
  ``fair_unknown_returns`` counting its returns, where a worker that knows the
  task takes it.  After ``fair_unknown_task_max_returns`` returns it is parked.

A message waiting to be sent back stays unacknowledged, like an ETA task: if the worker stops
or dies, the broker gives it to another (Redis: the visibility timeout).  As
Celery does for ETA tasks, holding raises the prefetch window by one (up to
the worker's initial window in all), so that messages waiting to be sent back do not starve the
tasks the worker can run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import compat
from ..kombu.cycle import channel_closed
from ..kombu.requeue import requeue
from ..parked import PARKED_LOG
from ..parking.store import Parking, parking_for
from ..scheduling.dispatch import SendBack
from ..wire import MAX_BACKLOG_HEADER, RETURNS_HEADER

__all__ = ("Quarantine", "QuarantineStatistics", "returns_of")

logger = logging.getLogger(__name__)

#: At most one "returned unknown task" line per task name in this many seconds.
_LOG_EVERY = 60.0


def returns_of(headers: Any) -> int:
    """The :data:`RETURNS_HEADER` count of a message's headers (0 if absent or bad)."""
    try:
        return max(0, int((headers or {}).get(RETURNS_HEADER) or 0))
    except (TypeError, ValueError, AttributeError):
        return 0


@dataclass(frozen=True)
class QuarantineStatistics:
    """Bad input seen by this worker (``inspect fair_stats`` -> ``bad_input``)."""

    #: Messages parked, by cause (``undecodable``, ``not-accepted``,
    #: ``not-a-task``, ``unknown-task``).
    parked: dict[str, int] = field(default_factory=dict)
    #: Unknown tasks sent back for a worker that knows them.
    returned: int = 0
    #: Unknown tasks waiting now to be sent back.
    returning: int = 0
    #: Messages that could be neither parked nor returned (left to the broker).
    errors: int = 0


class Quarantine:
    """The consumer's bad-input handlers (installed at every consumer start)."""

    def __init__(
        self,
        *,
        delay: float,
        max_returns: int,
        queue_of: Callable[[Any], str | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.delay = delay
        self.max_returns = max_returns
        self.queue_of = queue_of
        self.clock = clock
        self.parking: Parking | None = None
        self._consumer: Any = None
        self._parked: dict[str, int] = {}
        self._returned = self._returning = self._raised = self._errors = 0
        self._logged: dict[str, float] = {}

    def install(self, consumer: Any) -> bool:
        """Take over ``consumer``'s bad-input handlers (probed); False if Celery's stay."""
        if not compat.probe_bad_input_handlers(consumer, consumer.controller.fair.probe):
            return False
        self._consumer = consumer
        dead_letter = {
            q.name
            for q in consumer.task_consumer.queues
            if (q.queue_arguments or {}).get("x-dead-letter-exchange") is not None
        }
        self.parking = parking_for(
            consumer.task_consumer.channel, dead_letter=dead_letter.__contains__
        )
        compat.set_bad_input_handlers(
            consumer,
            {
                "on_decode_error": self.on_decode_error,
                "on_invalid_task": self.on_invalid_task,
                "on_unknown_message": self.on_unknown_message,
                "on_unknown_task": self.on_unknown_task,
            },
        )
        return True

    # -- Celery's handlers ----------------------------------------------------

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self.park(message, "undecodable", f"body does not decode: {_describe(exc)}")

    def on_invalid_task(self, body: Any, message: Any, exc: BaseException) -> None:
        self.park(message, "not-accepted", f"invalid or not accepted: {_describe(exc)}")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self.park(message, "not-a-task", "not a task message (no task name)")

    def on_unknown_task(self, body: Any, message: Any, exc: BaseException) -> None:
        name = _task_name(message)
        count = returns_of(message.headers)
        if count >= self.max_returns:
            self.park(
                message,
                "unknown-task",
                f"unknown task {name!r}: no worker took it in {count} returns",
            )
            return
        consumer = self._consumer
        raise_window = self._raised < max(1, int(getattr(consumer, "initial_prefetch_count", 1)))
        if raise_window:
            consumer.qos.increment_eventually()
            self._raised += 1
        self._returning += 1
        consumer.timer.call_after(self.delay, self._send_back, (message, name, count, raise_window))

    # -- actions --------------------------------------------------------------

    def park(self, message: Any, cause: str, reason: str) -> None:
        """Keep ``message`` on the broker with ``reason``; log one line."""
        info = getattr(message, "delivery_info", None) or {}
        # Named after the queue it came from (its routing key if the queue is unknown).
        queue = self.queue_of(message) or str(info.get("routing_key") or "unknown")
        parking = self.parking
        try:
            if parking is None:
                raise RuntimeError("no parking place (consumer not started)")
            where = parking.park(message, queue, reason)
        except Exception:  # noqa: BLE001 - leaving it unacknowledged beats losing it
            self._errors += 1
            logger.error(
                "celery-fair: could not park a message of queue %r (%s); left to the broker",
                queue, reason, exc_info=True,
            )  # fmt: skip
            return
        self._parked[cause] = self._parked.get(cause, 0) + 1
        logger.error(PARKED_LOG, queue, where, reason)

    def park_request(self, request: Any, reason: str) -> None:
        """Park a received task that cannot run here (``reason``); the worker forgets it."""
        from celery.worker.state import task_ready

        message = getattr(request, "message", None)
        self.park(message, "unfit", f"task {getattr(request, 'name', '?')}: {reason}")
        if message is not None and message.acknowledged:
            task_ready(request)

    def _send_back(self, message: Any, name: str, count: int, raised_window: bool) -> None:
        self._returning -= 1
        if raised_window:
            self._raised -= 1
            self._consumer.qos.decrement_eventually()
        if message.acknowledged or channel_closed(message.channel):
            return  # the transport gave it back already (reconnection, shutdown)
        # Unknown queue (None): the copy goes to the exchange and routing key it came with.
        queue = self.queue_of(message)
        headers: dict[str, Any] = {RETURNS_HEADER: count + 1}
        cap = (message.headers or {}).get(MAX_BACKLOG_HEADER)
        if cap is not None:
            # Celery never received it (no task_received): its place in its key's
            # backlog counter is still taken, and the copy keeps it.
            headers[MAX_BACKLOG_HEADER] = cap
        back = SendBack("unknown-task", queue, headers, front=False)
        if not requeue(
            message, back, log=logger,
            failure="celery-fair: could not send back unknown task %r of queue %r",
            args=(name, queue),
        ):  # fmt: skip
            self._errors += 1  # unacknowledged, the broker redelivers it
            return
        self._returned += 1
        now = self.clock()
        if now - self._logged.get(name, -_LOG_EVERY) >= _LOG_EVERY:
            self._logged[name] = now
            logger.warning(
                "celery-fair: this worker does not know task %r: sent back to queue %r for "
                "a worker that does (return %d of at most %d, then parked)",
                name, queue, count + 1, self.max_returns,
            )  # fmt: skip

    def statistics(self) -> QuarantineStatistics:
        return QuarantineStatistics(
            parked=dict(self._parked),
            returned=self._returned,
            returning=self._returning,
            errors=self._errors,
        )


def _task_name(message: Any) -> str:
    headers = getattr(message, "headers", None) or {}
    name = headers.get("task") if isinstance(headers, dict) else None
    if name is None:
        try:  # task protocol 1: the name is in the body
            name = message.payload.get("task")
        except Exception:  # noqa: BLE001
            name = None
    return str(name)


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
