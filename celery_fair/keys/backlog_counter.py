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

A task the broker redelivers after a crash frees no second place
(:mod:`celery_fair.worker.backlog`).  The counters are approximate where a
task leaves without a worker receiving it as celery-fair does
(docs/fairness-keys.md): a task taken by a plain Celery worker after
``celery fair keys unkey`` frees none.  Markers are transient, so a broker
restart empties the counters, unless ``fair_key_max_backlog_durable`` makes
a persistent task's marker persistent: a publish with a confirm then waits
for the broker's disk, which about halves a capped publish's rate
(``bench/results/broker_cost_rabbitmq_caps_durable.md``).

The counters live on a :class:`~.side_connection.SideConnection` of their
own, as the limit tokens do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic
from typing import Any

from ..errors import KeyBacklogFull
from .lanes import KeyLanes
from .side_connection import SideConnection
from .tokens import TOKEN_EXPIRES

__all__ = ("BacklogCounter",)

logger = logging.getLogger(__name__)

#: A counter unused (no worker took a marker, no producer declared it) for a day is
#: deleted by the broker, as the limit tokens' queues are.
COUNTER_EXPIRES = TOKEN_EXPIRES
#: Seconds between a producer's declarations of one counter: they keep it from
#: expiring while only producers use it (publishing is not use for ``x-expires``).
_DECLARE_EVERY = 600.0
#: The channel markers are published and taken on.
_CHANNEL = "counters"


class BacklogCounter:
    """The counters of capped keys on the broker of ``connect()`` (a new, unconnected
    Kombu connection at each call).  Thread-safe; a forked child opens its own."""

    def __init__(
        self, connect: Callable[[], Any], *, clock: Callable[[], float] = monotonic
    ) -> None:
        self._clock = clock
        self.side = SideConnection(connect, "key backlog counters", clock=clock)
        #: Counter name -> when it was declared, and on which of the side's connections.
        self._declared: dict[str, tuple[float, int]] = {}
        #: Markers published, refused (publishes over a cap), taken.
        self.claimed = self.refused = self.released = 0

    def claim(
        self,
        queue: str,
        key: str,
        cap: int,
        *,
        expires_in: float | None = None,
        persistent: bool = False,
    ) -> bool:
        """Count a task of ``key`` about to be published to keyed ``queue``.

        ``expires_in``: the task's own time to live in the broker (Celery
        publishes a task's ``expires`` as one), given to the marker too: a
        task RabbitMQ drops unreceived takes its place with it.
        ``persistent``: the marker is persistent, so the count outlives a
        broker restart (``fair_key_max_backlog_durable``, for a task that does
        too); the broker then confirms it once it is on disk.

        True: counted.  False: the broker could not be asked (logged); the
        caller publishes the task uncounted rather than lose it.  Raises
        :class:`~celery_fair.errors.KeyBacklogFull` when the key has ``cap``
        tasks waiting: nothing is counted, and the task must not be published.
        """
        from amqp import Message
        from amqp.exceptions import MessageNacked

        name = KeyLanes.backlog_counter(queue, key, cap)
        with self.side.lock:
            channel = self.side.ready(_CHANNEL)
            if channel is None:
                return False
            try:
                self._declare(channel, name, cap)
                ttl = (
                    {}
                    if expires_in is None
                    else {"expiration": str(max(0, int(expires_in * 1000)))}
                )
                marker = Message(b"", delivery_mode=2 if persistent else 1, **ttl)
                channel.basic_publish_confirm(marker, exchange="", routing_key=name)
            except MessageNacked:
                self.refused += 1
                raise KeyBacklogFull(queue, key, cap, cap) from None
            except Exception as exc:  # noqa: BLE001 - the task goes on, uncounted
                self.side.failed(exc)
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
        with self.side.lock:
            channel = self.side.ready(_CHANNEL)
            if channel is None:
                return False
            try:
                got = channel.basic_get(name, no_ack=True)
            except self.side.errors_of()[1]:
                # No such counter (expired, or counted on another broker): RabbitMQ
                # closed the channel with a 404; the next call opens another.
                self.side.refused(_CHANNEL)
                return False
            except Exception as exc:  # noqa: BLE001 - the task runs; its place stays taken
                self.side.failed(exc)
                return False
            if got is None:
                return False
            self.released += 1
            return True

    def stats(self) -> dict[str, int]:
        """What ``inspect fair_stats`` shows under ``keys.backlog_counters``."""
        return {"claimed": self.claimed, "refused": self.refused,
                "released": self.released, "errors": self.side.errors}  # fmt: skip

    def _declare(self, channel: Any, name: str, cap: int) -> None:
        """Declare counter ``name`` on a new connection, and again now and then."""
        now, connection = self._clock(), self.side.connections
        when, on = self._declared.get(name, (0.0, 0))
        if on == connection and now - when < _DECLARE_EVERY:
            return
        channel.queue_declare(
            name, durable=True, auto_delete=False,
            arguments={"x-max-length": cap, "x-overflow": "reject-publish",
                       "x-expires": int(COUNTER_EXPIRES * 1000)},
        )  # fmt: skip
        self._declared[name] = (now, connection)

    def close(self) -> None:
        self.side.close()
