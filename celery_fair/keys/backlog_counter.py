"""Backlog caps on RabbitMQ: a capped key's waiting tasks counted in a queue of markers.

RabbitMQ counts the messages of a queue, not of a key inside it, and a keyed
queue's lanes hold many keys each (:mod:`celery_fair.keys.lanes`).  So a
capped key has a **counter**: a queue of empty markers, one for each task of
the key published and not yet received by a worker, declared with
``x-max-length`` of the cap and ``x-overflow: reject-publish``
(https://www.rabbitmq.com/docs/maxlength).  Its name carries the cap
(:meth:`~celery_fair.keys.lanes.KeyLanes.backlog_counter`), so a changed cap
is a new counter, and a task frees a place in the counter it was counted in
(its ``fair_max_backlog`` header).

* **Producer** (:meth:`BacklogCounter.claim`): a marker published with a
  publisher confirm, before the task.  The broker refuses it (a nack) when
  the counter holds the cap: the task is not published and
  :class:`~celery_fair.errors.KeyBacklogFull` is raised.  The broker decides,
  so concurrent producers never pass the cap together.
* **Worker** (:meth:`BacklogCounter.release`): a marker taken
  (``basic.get``, no ack) as the worker receives the task: as on Redis,
  waiting is what is counted, and a task fetched frees its place.

The counters are approximate where a task leaves without a worker receiving
it as celery-fair does, and after a crash (docs/fairness-keys.md): a
redelivered task frees a second place (the key can exceed its cap by the
tasks in flight, as a restore on Redis may), and a task taken by a plain
Celery worker after ``celery fair keys unkey`` frees none.  Markers are
transient: a broker restart empties the counters.

The counters live on a connection of their own with heartbeats off (nothing
reads it between calls), as the limit tokens' do (:mod:`.token_client`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

from ..errors import KeyBacklogFull
from .lanes import KeyLanes
from .token_client import broker_errors, close_copy
from .tokens import TOKEN_EXPIRES

__all__ = ("BacklogCounter",)

logger = logging.getLogger(__name__)

#: A counter unused (no worker took a marker, no producer declared it) for a day is
#: deleted by the broker, as the limit tokens' queues are.
COUNTER_EXPIRES = TOKEN_EXPIRES
#: Seconds between a producer's declarations of one counter: they keep it from
#: expiring while only producers use it (publishing is not use for ``x-expires``).
_DECLARE_EVERY = 600.0
#: Seconds a failed connection is not tried again.
_RETRY_AFTER = 1.0


class BacklogCounter:
    """The counters of capped keys on the broker of ``connect()`` (a new, unconnected
    Kombu connection at each call).  Thread-safe; a forked child opens its own."""

    def __init__(
        self, connect: Callable[[], Any], *, clock: Callable[[], float] = monotonic
    ) -> None:
        self._connect = connect
        self._clock = clock
        self._lock = threading.RLock()
        self._connection: Any = None
        self._channel: Any = None
        self._failed_at: float | None = None
        self._declared: dict[str, float] = {}
        #: Markers published, refused (publishes over a cap), taken; broker failures.
        self.claimed = self.refused = self.released = self.errors = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    def claim(self, queue: str, key: str, cap: int, *, expires_in: float | None = None) -> bool:
        """Count a task of ``key`` about to be published to keyed ``queue``.

        ``expires_in``: the task's own time to live in the broker (Celery
        publishes a task's ``expires`` as one), given to the marker too: a
        task RabbitMQ drops unreceived takes its place with it.

        True: counted.  False: the broker could not be asked (logged); the
        caller publishes the task uncounted rather than lose it.  Raises
        :class:`~celery_fair.errors.KeyBacklogFull` when the key has ``cap``
        tasks waiting: nothing is counted, and the task must not be published.
        """
        from amqp import Message
        from amqp.exceptions import MessageNacked

        name = KeyLanes.backlog_counter(queue, key, cap)
        with self._lock:
            channel = self._ready()
            if channel is None:
                return False
            try:
                self._declare(channel, name, cap)
                ttl = (
                    {}
                    if expires_in is None
                    else {"expiration": str(max(0, int(expires_in * 1000)))}
                )
                marker = Message(b"", delivery_mode=1, **ttl)
                channel.basic_publish_confirm(marker, exchange="", routing_key=name)
            except MessageNacked:
                self.refused += 1
                raise KeyBacklogFull(queue, key, cap, cap) from None
            except Exception as exc:  # noqa: BLE001 - the task goes on, uncounted
                self._failed(exc)
                return False
            self.claimed += 1
            return True

    def release(self, queue: str, key: str, cap: int) -> bool:
        """A task of ``key`` counted in ``cap``'s counter left the broker: free its place.

        False if no marker was taken (the counter is gone or empty, or the
        broker failed: logged); nothing is retried, a lost release only keeps
        a place taken until the counter expires.
        """
        name = KeyLanes.backlog_counter(queue, key, cap)
        with self._lock:
            channel = self._ready()
            if channel is None:
                return False
            try:
                got = channel.basic_get(name, no_ack=True)
            except broker_errors(self._connection)[1]:
                # No such counter (expired, or counted on another broker): RabbitMQ
                # closed the channel with a 404; the next call opens another.
                self._channel = None
                return False
            except Exception as exc:  # noqa: BLE001 - the task runs; its place stays taken
                self._failed(exc)
                return False
            if got is None:
                return False
            self.released += 1
            return True

    def stats(self) -> dict[str, int]:
        """What ``inspect fair_stats`` shows under ``keys.backlog_counters``."""
        return {"claimed": self.claimed, "refused": self.refused,
                "released": self.released, "errors": self.errors}  # fmt: skip

    # -- the connection ---------------------------------------------------------

    def _ready(self) -> Any:
        """The open channel, connecting if needed; None while the broker cannot be reached."""
        if self._channel is not None:
            return self._channel
        if self._failed_at is not None and self._clock() - self._failed_at < _RETRY_AFTER:
            return None
        try:
            if self._connection is None:
                connection = self._connect()
                connection.ensure_connection(max_retries=1)
                self._connection = connection
                self._declared.clear()
            self._channel = self._connection.channel()
        except Exception as exc:  # noqa: BLE001 - any broker failure: try again later
            self._failed(exc)
            return None
        self._failed_at = None
        return self._channel

    def _declare(self, channel: Any, name: str, cap: int) -> None:
        now = self._clock()
        if now - self._declared.get(name, -_DECLARE_EVERY) < _DECLARE_EVERY:
            return
        channel.queue_declare(
            name, durable=True, auto_delete=False,
            arguments={"x-max-length": cap, "x-overflow": "reject-publish",
                       "x-expires": int(COUNTER_EXPIRES * 1000)},
        )  # fmt: skip
        self._declared[name] = now

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._failed_at = self._clock()
        logger.warning("celery-fair: key backlog counters: the broker connection failed: %r", exc)
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.release()

    def _forget_in_child(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        close_copy(connection)
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            connection, self._connection, self._channel = self._connection, None, None
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.release()
