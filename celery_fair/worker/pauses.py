"""Paused keys in the worker: prefetched tasks of a paused key go back, none starts.

A pause is stored on the broker (``control fair_key_pause``): from then on
the fetch script serves nothing of the key.  Tasks of the key the worker had
already prefetched wait in its buffer; they must not start either.  When one
is about to leave the buffer, this sends it and every other buffered task of
its key back to the front of the key's list, newest first, so that the key's
messages keep their order when it is resumed.  The returned copies are
published before the originals are acknowledged: a crash in between leaves a
duplicate, never a loss (:func:`celery_fair.kombu.requeue.requeue`, as CoDel's returns).

The worker learns of pauses from the control command (at once) and by
reading the paused sets every :data:`PAUSED_RECHECK` seconds (a worker that
started later, or missed the broadcast).

On RabbitMQ the pause is an event in a log every worker reads
(:mod:`celery_fair.keys.pause_log`), and a paused key's prefetched tasks
go, oldest first, to the back of the key's parked lane, which no worker
consumes until the key is resumed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..kombu.requeue import requeue
from ..scheduling.dispatch import SendBack

__all__ = ("PAUSED_RECHECK", "PausedKeys")

logger = logging.getLogger(__name__)

#: Seconds between two reads of the paused keys from the broker.
PAUSED_RECHECK = 2.0


class PausedKeys:
    """The paused keys of this worker's keyed queues, as last read or told."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paused: dict[str, frozenset[str]] = {}
        #: Prefetched tasks sent back because their key was paused.
        self.returned = 0
        #: RabbitMQ: ``park(queue, key)`` names the queue where a paused key's tasks
        #: wait (:func:`~celery_fair.keys.pause_events.parked_lane`); None on Redis,
        #: where they go back to the front of the key's list.
        self.park: Callable[[str, str], str] | None = None

    def replace(self, paused: Mapping[str, Iterable[str]]) -> None:
        """The paused keys per keyed queue, as read from the broker."""
        fresh = {queue: frozenset(keys) for queue, keys in paused.items() if keys}
        with self._lock:
            self._paused = fresh

    def change(self, queue: str, keys: Iterable[str], paused: bool) -> None:
        """Keys of ``queue`` paused (or resumed) by a control command."""
        with self._lock:
            now = set(self._paused.get(queue, ()))
            (now.update if paused else now.difference_update)(keys)
            self._paused = {**self._paused, queue: frozenset(now)}

    def is_paused(self, queue: str, key: str | None) -> bool:
        """Whether ``key`` of keyed ``queue`` is paused."""
        return key is not None and key in self._paused.get(queue, ())

    def any(self) -> bool:
        return any(self._paused.values())

    def check(self, queue: str, key: str | None) -> SendBack | None:
        """The admission loop's pause check: a paused key's task goes back with its key's
        other buffered tasks, to the front of the key's list (RabbitMQ: to the back of
        its parked lane)."""
        if not self.is_paused(queue, key):
            return None
        if self.park is not None and key is not None:
            return SendBack("paused", self.park(queue, key), key=key, front=False)
        return SendBack("paused", queue, key=key)

    def send_back(
        self, entries: list[Any], back: SendBack, request_of: Callable[[Any], Any],
        done: Callable[[Any], None],
    ) -> list[Any]:  # fmt: skip
        """Return buffered ``entries`` (a paused key's, oldest first) as ``back`` says.

        Newest first to the front of a list, so that the oldest ends first in
        line; oldest first to the back of a queue.  ``done(request)``
        tells Celery's worker state a request is finished here.  Returns the
        entries that could not be sent back (oldest first), for the caller to
        keep: running a task beats losing it.
        """
        kept: list[Any] = []
        for entry in reversed(entries) if back.front else list(entries):
            request = request_of(entry)
            if not requeue(
                request.message, back, log=logger,
                failure="celery-fair: could not return %s of a paused key to the broker",
                args=(getattr(request, "id", "?"),), ack=request.acknowledge,
            ):  # fmt: skip
                kept.insert(0 if back.front else len(kept), entry)
                continue
            done(request)
            self.returned += 1
        return kept
