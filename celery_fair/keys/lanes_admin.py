"""``celery fair keys backlog|unkey`` for a keyed queue on RabbitMQ: its lanes, read or emptied.

``backlog`` counts what waits in each lane (a passive ``queue.declare`` per
lane: the broker's count of ready messages, and its consumers), and, for the
keys named, what their backlog counters hold (:func:`capped`).  ``unkey``
moves every message of every lane into the queue itself, where any Celery
worker consumes it: the last step of a return to plain Celery
(docs/migrating.md).  Each message is taken with ``basic.get``, published
again to the queue with publisher confirms, and only then acknowledged: a
stop half way (or a crash) leaves at most a copy in both places, never a
loss.  The copy keeps the body, the headers and the properties.
:func:`declared` is the one passive read of a queue, the exporter's too.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .lanes import KeyLanes, every_lane
from .publish import cap_for

__all__ = ("CappedKey", "LaneCount", "QueueMissing", "backlog", "capped", "declared", "unkey")


@dataclass(frozen=True)
class LaneCount:
    """One lane's ready messages and consumers (None: the lane is not declared)."""

    lane: str
    messages: int | None
    consumers: int | None


def backlog(connection: Any, queue: str) -> list[LaneCount]:
    """What waits in keyed ``queue`` on RabbitMQ: the queue itself, then each lane.

    ``connection`` is a Kombu connection to RabbitMQ.
    """
    counts = []
    channel = connection.channel()
    try:
        for name in (queue, *every_lane(queue)):
            ready, consumers, channel = declared(connection, channel, name)
            counts.append(LaneCount(name, ready, consumers))
    finally:
        channel.close()
    return counts


@dataclass(frozen=True)
class CappedKey:
    """A key's cap (None: none) and the tasks its counter holds as waiting (None: no
    counter, as no capped task of the key was published since it last expired)."""

    key: str
    cap: int | None
    waiting: int | None


def capped(
    connection: Any, queue: str, keys: Iterable[str], caps: Mapping[str, int]
) -> list[CappedKey]:
    """The counters of ``keys`` of keyed ``queue`` under ``caps`` (``fair_key_max_backlog``
    parsed): what each key has waiting as the producers count it
    (:mod:`~celery_fair.keys.backlog_counter`)."""
    found = []
    channel = connection.channel()
    try:
        for key in dict.fromkeys(keys):
            cap = cap_for(caps, key)
            waiting = None
            if cap is not None:
                name = KeyLanes.backlog_counter(queue, key, cap)
                waiting, _, channel = declared(connection, channel, name)
            found.append(CappedKey(key, cap, waiting))
    finally:
        channel.close()
    return found


def declared(connection: Any, channel: Any, queue: str) -> tuple[int | None, int | None, Any]:
    """(messages ready, consumers, the channel to go on with) of ``queue``, by a passive
    declare; (None, None, a new channel) when it is not declared, as the broker closes
    the channel of a passive declare of a missing queue."""
    try:
        ok = channel.queue_declare(queue=queue, passive=True)
    except connection.channel_errors:
        # py-amqp reopens a channel the broker closed: closed here, not left open.
        with contextlib.suppress(Exception):
            channel.close()
        return None, None, connection.channel()
    return int(ok.message_count), int(ok.consumer_count), channel


class QueueMissing(LookupError):
    """The keyed queue itself is not declared: a move into it would be lost."""


def unkey(
    connection: Any,
    queue: str,
    *,
    declare: Any = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[str, int]]:
    """Move every message of ``queue``'s lanes into ``queue``; yields (lane, moved) per lane.

    ``connection`` is a Kombu connection to RabbitMQ.  ``declare``: the
    queue's Kombu ``Queue`` (from the app), declared first; without it the
    queue must exist (:class:`QueueMissing`).  Each copy is published
    ``mandatory``: one the broker cannot route raises before its original is
    acknowledged.  ``progress(total)`` is called after each message moved.
    """
    channel = connection.channel()
    try:
        if declare is not None:
            declare(channel).declare()
        else:
            ready, _, channel = declared(connection, channel, queue)
            if ready is None:
                raise QueueMissing(
                    f"queue {queue!r} is not declared; start a worker on it, or name the app "
                    "(-A) so that it is declared as the app declares it"
                )
        total = 0
        for lane in every_lane(queue):
            ready, _, channel = declared(connection, channel, lane)
            if not ready:
                continue
            moved = 0
            while (message := channel.basic_get(lane, no_ack=False)) is not None:
                # Published (and confirmed) before the ack: a crash leaves a copy, not a loss.
                channel.basic_publish_confirm(
                    message, exchange="", routing_key=queue, mandatory=True
                )
                channel.basic_ack(message.delivery_tag)
                moved += 1
                total += 1
                if progress is not None:
                    progress(total)
            yield lane, moved
    finally:
        channel.close()


def print_backlog(
    counts: list[LaneCount], queue: str, *, as_json: bool, keys: list[CappedKey] | None = None
) -> None:
    """``keys backlog`` on RabbitMQ: the total, then each lane holding messages, then the
    keys named with their caps."""
    total = sum(c.messages or 0 for c in counts)
    if as_json:
        lanes = {c.lane: {"messages": c.messages, "consumers": c.consumers} for c in counts}
        record: dict[str, Any] = {"queue": queue, "messages": total, "lanes": lanes}
        if keys is not None:
            record["keys"] = {k.key: {"cap": k.cap, "waiting": k.waiting} for k in keys}
        print(json.dumps(record, indent=2))
        return
    declared = sum(c.messages is not None for c in counts[1:])
    print(f"{queue}: {total} message(s) in the queue and its {declared} lanes")
    for c in counts:
        if c.messages:
            print(f"  {c.lane}: {c.messages} ({c.consumers} consumer(s))")
    missing = [c.lane for c in counts if c.messages is None]
    if missing:
        print(f"  not declared: {len(missing)} lane(s) (the priority levels' lanes exist only "
              "for a queue declared with a maximum priority)")  # fmt: skip
    if keys:
        print("keys (waiting as their backlog counters count them, of fair_key_max_backlog):")
    for k in keys or ():
        if k.cap is None:
            print(f"  {k.key}: no cap (RabbitMQ counts a key's tasks only under a cap)")
        else:
            print(f"  {k.key}: {k.waiting or 0} of {k.cap}")


class Progress:
    """Prints how many messages moved, at most every ``every`` seconds."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._shown = time.monotonic()

    def __call__(self, total: int) -> None:
        if time.monotonic() - self._shown >= self.every:
            self._shown = time.monotonic()
            print(f"moved {total} message(s)", flush=True)
