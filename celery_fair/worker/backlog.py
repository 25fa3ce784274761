"""Backlog caps on RabbitMQ, the worker's part: a capped task frees its place as it arrives.

A producer counts each capped task in its key's counter before publishing it
(:mod:`celery_fair.keys.backlog_counter`).  The worker frees the place when
the task leaves the broker's waiting tasks, which is when Celery receives
it: on Celery's ``task_received`` signal, before a countdown or an ETA is
waited for, as on Redis where a fetched task is no longer counted.  A task
revoked or expired as it is received is acknowledged by Celery without that
signal: its ``task_revoked`` frees the place instead, unless this worker
received the task before (a revoke after receipt, or of a running task).

The cap is the producer's setting: the worker frees the place of any task
stamped with one (``fair_max_backlog``), whatever its own settings.

A task the broker **redelivers** (AMQP's ``redelivered`` flag: a worker died
or closed its channel holding it) freed its place when it was first
delivered, to a celery-fair worker: it frees none again.  While such tasks
are on their way back, the counter holds fewer than wait; once they are
received again it is exact.  A place is lost (held until the counter
expires) only if the first worker died between receiving the task and
freeing its place, or was a plain Celery worker.

The places are freed by a thread of their own, in the order the tasks came:
each is a ``basic.get`` round trip, which on the event loop would halve the
throughput of short tasks.  A place is free a moment after its task arrived.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from .. import compat
from ..keys.backlog_counter import BacklogCounter
from ..keys.publish import backlog_cap
from ..wire import KEY_HEADER, MAX_BACKLOG_HEADER
from .queue_map import QueueMap

__all__ = ("BacklogReleases",)

logger = logging.getLogger(__name__)

#: Seconds the worker's shutdown waits for the places still to free.
DRAIN_TIMEOUT = 5.0
#: Task ids remembered as received, to tell a revoke at receipt (the place is
#: freed then) from a later one (it was freed at receipt).
RECEIVED_REMEMBERED = 65_536


class BacklogReleases:
    """Frees the places of capped tasks of ``queue_map``'s keyed queues in ``counter``
    (on a thread of its own; ``background=False``: at once, in the caller)."""

    def __init__(
        self, counter: BacklogCounter, queue_map: QueueMap, *, background: bool = True
    ) -> None:
        self.counter = counter
        self.queue_map = queue_map
        self._received: OrderedDict[str, None] = OrderedDict()
        self._connected = False
        self._background = background
        self._pending: SimpleQueue[tuple[str, str, int] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def on_received(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """Celery's ``task_received``: ``request`` is the worker's ``Request``."""
        if _redelivered(request):
            return
        if not self._release(request, compat.request_headers(request).get):
            return
        task_id = getattr(request, "id", None)
        if isinstance(task_id, str):
            self._received[task_id] = None
            self._received.move_to_end(task_id)
            if len(self._received) > RECEIVED_REMEMBERED:
                self._received.popitem(last=False)

    def on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """Celery's ``task_revoked``: ``request`` is the task's context."""
        if getattr(request, "id", None) in self._received or _redelivered(request):
            return
        self._release(request, lambda name: getattr(request, name, None))

    def _release(self, request: Any, get: Callable[[str], Any]) -> bool:
        """Free a capped task's place; whether it was one (of a keyed queue here)."""
        cap = backlog_cap(get(MAX_BACKLOG_HEADER))
        if cap is None:
            return False
        queue = self.queue_map.queue_of(request)
        lanes = self.queue_map.lanes
        if queue is None or lanes is None or queue not in lanes.keyed:
            return False
        key = get(KEY_HEADER)
        place = (queue, key if isinstance(key, str) else "", cap)
        if not self._background:
            self.counter.release(*place)
            return True
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="celery-fair-backlog-releases", daemon=True
            )
            self._thread.start()
        self._pending.put(place)
        return True

    def _run(self) -> None:
        while (place := self._pending.get()) is not None:
            try:
                self.counter.release(*place)
            except Exception:  # noqa: BLE001 - the thread must outlive any one release
                logger.exception("celery-fair: key backlog counters: a release failed")

    def connect(self) -> None:
        """Receive Celery's signals (once)."""
        from celery import signals

        if not self._connected:
            signals.task_received.connect(self.on_received, weak=False)
            signals.task_revoked.connect(self.on_revoked, weak=False)
            self._connected = True

    def disconnect(self) -> None:
        from celery import signals

        if self._connected:
            signals.task_received.disconnect(self.on_received)
            signals.task_revoked.disconnect(self.on_revoked)
            self._connected = False
        thread, self._thread = self._thread, None
        if thread is not None:
            self._pending.put(None)
            thread.join(DRAIN_TIMEOUT)
        self.counter.close()


def _redelivered(request: Any) -> bool:
    """Whether the broker delivered ``request``'s message before (Celery's request and
    task context both carry AMQP's flag in ``delivery_info``)."""
    info = getattr(request, "delivery_info", None)
    return bool(isinstance(info, dict) and info.get("redelivered"))
