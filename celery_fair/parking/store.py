"""Where parked messages live on each broker: park, list, replay, purge.

Redis keeps a JSON record per message (:mod:`celery_fair.parked`) in the list
``<queue>.fair-malformed``, the same list the atomic fetch script moves
payloads with no delivery tag to.  RabbitMQ keeps the message itself on a
durable queue of that name, declared by celery-fair, with the reason headers
added; when the message's queue has a dead-letter exchange, the message is
rejected instead and the broker dead-letters it.

Every move writes the new copy before removing the old one: a crash in
between leaves a duplicate, never a loss.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .. import compat
from ..parked import PARKED_HEADERS, ParkedMessage, decode_record, encode_record, parking_queue
from ..wire import AT_HEADER, FROM_HEADER, REASON_HEADER

__all__ = ("AmqpParking", "Parking", "RedisParking", "parking_for")


class Parking(Protocol):
    """The parking place of one broker connection."""

    def park(self, message: Any, queue: str, reason: str) -> str:
        """Keep ``message`` (taken from ``queue``) with ``reason``; settle the original.

        Returns where it went (for the log line).
        """

    def list(self, queue: str, limit: int | None = None) -> list[ParkedMessage]:
        """The messages parked from ``queue``, oldest first."""

    def replay(self, queue: str, limit: int | None = None) -> int:
        """Put parked messages back on ``queue``, oldest first; returns how many."""

    def purge(self, queue: str) -> int:
        """Drop the messages parked from ``queue``; returns how many."""


class RedisParking:
    """Parked messages on Redis: one list of JSON records per queue."""

    def __init__(self, channel: Any, *, clock: Callable[[], float] = time.time) -> None:
        self.channel = channel
        self.clock = clock
        self._prefix = compat.key_prefix(channel)

    def _key(self, queue: str) -> str:
        return self._prefix + parking_queue(queue)

    def park(self, message: Any, queue: str, reason: str) -> str:
        payload = compat.raw_payload(message)
        raw = None
        if payload is None:
            body = message.body
            raw = body.decode("utf-8", "surrogateescape") if isinstance(body, bytes) else str(body)
        record = encode_record(payload, reason=reason, parked_at=self.clock(), queue=queue, raw=raw)
        with compat.redis_client(self.channel) as client:
            client.lpush(self._key(queue), record)
        message.ack()
        return parking_queue(queue)

    def list(self, queue: str, limit: int | None = None) -> list[ParkedMessage]:
        start = 0 if limit is None else -limit
        with compat.redis_client(self.channel) as client:
            items = client.lrange(self._key(queue), start, -1)
        # LPUSH adds on the left: the oldest is last.
        return [decode_record(item, queue) for item in reversed(items)]

    def replay(self, queue: str, limit: int | None = None) -> int:
        from ..kombu.requeue import put_payload

        key, done = self._key(queue), 0
        with compat.redis_client(self.channel) as client:
            # Only what is parked now: a replayed message that is still bad is
            # parked again, at the other end of the list, and must not loop.
            count = int(client.llen(key))
            limit = count if limit is None else min(limit, count)
            while done < limit:
                item = client.lindex(key, -1)
                if item is None:
                    break
                parked = decode_record(item, queue)
                if parked.payload is not None:
                    payload = json.loads(json.dumps(parked.payload))
                    headers = payload.setdefault("headers", {})
                    for name in PARKED_HEADERS:
                        headers.pop(name, None)
                    put_payload(self.channel, queue, payload, front=False)
                elif parked.raw is not None:
                    # Not a message: put back as it was (it parks again unless fixed).
                    raw = parked.raw.encode("utf-8", "surrogateescape")
                    client.lpush(self._prefix + queue, raw)
                client.lrem(key, -1, item)
                done += 1
        return done

    def purge(self, queue: str) -> int:
        with compat.redis_client(self.channel) as client:
            pipe = client.pipeline()
            pipe.llen(self._key(queue))
            pipe.delete(self._key(queue))
            count, _ = pipe.execute()
        return int(count)


class AmqpParking:
    """Parked messages on RabbitMQ: a durable queue per queue, or its dead-letter exchange."""

    def __init__(
        self,
        channel: Any,
        *,
        dead_letter: Callable[[str], bool] = lambda queue: False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.channel = channel
        self.dead_letter = dead_letter
        self.clock = clock
        self._declared: set[str] = set()

    def _declare(self, channel: Any, queue: str) -> str:
        name = parking_queue(queue)
        if name not in self._declared:
            channel.queue_declare(queue=name, durable=True, auto_delete=False)
            self._declared.add(name)
        return name

    def park(self, message: Any, queue: str, reason: str) -> str:
        if self.dead_letter(queue):
            message.reject(requeue=False)
            return "its dead-letter exchange"
        from ..kombu.requeue import copy_properties, producer_on

        channel = message.channel
        name = self._declare(channel, queue)
        headers = dict(message.headers or {})
        headers.update({REASON_HEADER: reason, AT_HEADER: self.clock(), FROM_HEADER: queue})
        producer_on(channel).publish(
            message.body,
            exchange="",
            routing_key=name,
            headers=headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            **copy_properties(message),
        )
        message.ack()
        return name

    def _get_all(self, channel: Any, queue: str, limit: int | None) -> list[Any]:
        """The messages parked now (at most ``limit``), taken unacknowledged."""
        from kombu.entity import Queue

        name = parking_queue(queue)
        # Only what is parked now: a replayed message that is still bad is
        # parked again, behind these, and must not loop.
        count = int(channel.queue_declare(queue=name, durable=True, auto_delete=False)[1])
        self._declared.add(name)
        limit = count if limit is None else min(limit, count)
        parked: Any = Queue(name, channel=channel)  # type: ignore[no-untyped-call]
        messages: list[Any] = []
        while len(messages) < limit:
            message = parked.get(no_ack=False)
            if message is None:
                break
            messages.append(message)
        return messages

    def list(self, queue: str, limit: int | None = None) -> list[ParkedMessage]:
        channel = self.channel.connection.channel()
        try:
            # Not acknowledged: closing the channel puts them all back.
            return [_parked_amqp(m, queue) for m in self._get_all(channel, queue, limit)]
        finally:
            channel.close()

    def replay(self, queue: str, limit: int | None = None) -> int:
        from ..kombu.requeue import copy_properties, producer_on

        channel = self.channel.connection.channel()
        try:
            producer = producer_on(channel)
            done = 0
            for message in self._get_all(channel, queue, limit):
                headers = {
                    k: v for k, v in (message.headers or {}).items() if k not in PARKED_HEADERS
                }
                producer.publish(
                    message.body,
                    exchange="",
                    routing_key=str((message.headers or {}).get(FROM_HEADER) or queue),
                    headers=headers,
                    content_type=message.content_type,
                    content_encoding=message.content_encoding,
                    **copy_properties(message),
                )
                message.ack()
                done += 1
            return done
        finally:
            channel.close()

    def purge(self, queue: str) -> int:
        channel = self.channel.connection.channel()
        try:
            name = self._declare(channel, queue)
            return int(channel.queue_purge(name) or 0)
        finally:
            channel.close()


def _parked_amqp(message: Any, queue: str) -> ParkedMessage:
    headers: Mapping[str, Any] = message.headers or {}
    at = headers.get(AT_HEADER)
    task, task_id = headers.get("task"), headers.get("id")
    return ParkedMessage(
        reason=str(headers.get(REASON_HEADER) or "unknown"),
        parked_at=float(at) if isinstance(at, (int, float)) else None,
        queue=str(headers.get(FROM_HEADER) or queue),
        task=None if task is None else str(task),
        task_id=None if task_id is None else str(task_id),
    )


def parking_for(channel: Any, **kwargs: Any) -> RedisParking | AmqpParking:
    """The parking place for a Kombu channel: Redis lists, else broker queues."""
    if compat.is_redis_channel(channel):
        return RedisParking(channel, clock=kwargs.get("clock", time.time))
    return AmqpParking(channel, **kwargs)
