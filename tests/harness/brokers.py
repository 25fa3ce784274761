"""Fill queues with real Celery task messages and read their lengths.

One small class per broker so the harness, the tests and the benchmarks run
unchanged on Redis and on RabbitMQ.  Messages are made by Celery's own
message builder (``app.amqp.as_task_v2``) and copied with fresh ids.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ("AmqpBroker", "Broker", "RedisBroker", "broker_for", "publish_plain")

Args = Sequence[object] | Mapping[str, Sequence[object]]


class Broker(Protocol):
    url: str

    def fill(self, counts: Mapping[str, int], *, task: str = "work", args: Args = (0,)) -> None:
        """Push ``counts[q]`` task messages onto each queue ``q``."""

    def lengths(self, queues: Iterable[str]) -> dict[str, int]:
        """Messages ready in each queue (not counting those delivered)."""

    def purge(self, queues: Iterable[str]) -> None:
        """Empty the queues (and forget unacknowledged state)."""


def _qargs(args: Args, queue: str) -> Sequence[object]:
    return args[queue] if isinstance(args, Mapping) else args


def _app(url: str) -> Any:
    from celery import Celery

    app = Celery("celery_fair_filler", broker=url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    return app


class RedisBroker:
    """Kombu's Redis layout: a list per queue, LPUSH to publish."""

    def __init__(self, url: str) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url)

    def fill(self, counts: Mapping[str, int], *, task: str = "work", args: Args = (0,)) -> None:
        app = _app(self.url)
        try:
            for queue, n in counts.items():
                scratch = f"celery-fair-template-{uuid.uuid4().hex}"
                app.send_task(task, args=list(_qargs(args, queue)), queue=scratch)
                raw = self.client.rpop(scratch)
                self.client.delete(scratch)
                if raw is None:
                    raise RuntimeError("template message was not published")
                message: dict[str, Any] = json.loads(raw)  # type: ignore[arg-type]
                message["properties"]["delivery_info"] = {"exchange": "", "routing_key": queue}
                pipe = self.client.pipeline(transaction=False)
                for i in range(n):
                    tid = str(uuid.uuid4())
                    message["headers"]["id"] = message["headers"]["root_id"] = tid
                    message["properties"]["correlation_id"] = tid
                    message["properties"]["delivery_tag"] = str(uuid.uuid4())
                    pipe.lpush(queue, json.dumps(message))
                    if i % 5000 == 4999:
                        pipe.execute()
                pipe.execute()
        finally:
            app.close()

    def lengths(self, queues: Iterable[str]) -> dict[str, int]:
        names = list(queues)
        pipe = self.client.pipeline(transaction=False)
        for q in names:
            pipe.llen(q)
        return dict(zip(names, (int(n) for n in pipe.execute()), strict=True))

    def purge(self, queues: Iterable[str]) -> None:
        """Delete the queues' lists (every priority, every fair key) and their unacked records.

        Other keys of the database (other queues, a ledger) stay.
        """
        names = set(queues)
        client = self.client
        doomed: list[bytes] = []
        for queue in names:
            # A queue's lists: "q", "q\x06\x16<priority>", "q\x06\x16fair.*", "q.fair-*".
            doomed.append(queue.encode())
            pattern = _glob_escape(queue) + "[\x06.]*"
            doomed.extend(client.scan_iter(match=pattern, count=1000))
        tags = [tag for tag, record in client.hscan_iter("unacked") if _routed_to(record, names)]
        pipe = client.pipeline(transaction=False)
        for start in range(0, len(doomed), 1000):
            pipe.delete(*doomed[start : start + 1000])
        if tags:
            pipe.hdel("unacked", *tags)
            pipe.zrem("unacked_index", *tags)
        pipe.execute()


def _glob_escape(name: str) -> str:
    """``name`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in name)


def _routed_to(record: bytes, queues: set[str]) -> bool:
    """Whether a Kombu unacked record ``[payload, exchange, routing_key]`` is for ``queues``."""
    try:
        _payload, _exchange, routing_key = json.loads(record)
    except (ValueError, TypeError):
        return False
    return routing_key in queues


class AmqpBroker:
    """RabbitMQ: queues declared exactly as a Celery worker declares them."""

    def __init__(self, url: str, *, quorum: bool = False) -> None:
        self.url = url
        self.app = _app(url)
        self.quorum = quorum

    def _queue(self, name: str) -> Any:
        if self.quorum:
            from kombu.entity import Exchange, Queue

            return Queue(
                name, Exchange(name), routing_key=name, durable=True,
                queue_arguments={"x-queue-type": "quorum"},
            )  # fmt: skip
        return self.app.amqp.queues[name]

    def fill(self, counts: Mapping[str, int], *, task: str = "work", args: Args = (0,)) -> None:
        from kombu.connection import Connection

        with Connection(self.url) as conn:
            channel = conn.channel()
            producer = conn.Producer(channel)
            for queue, n in counts.items():
                q = self._queue(queue)
                q(channel).declare()
                for _ in range(n):
                    tid = str(uuid.uuid4())
                    msg = self.app.amqp.as_task_v2(tid, task, args=list(_qargs(args, queue)))
                    producer.publish(
                        msg.body,
                        exchange=q.exchange,
                        routing_key=q.routing_key,
                        headers=msg.headers,
                        serializer="json",
                        delivery_mode=2,
                        **msg.properties,
                    )

    def lengths(self, queues: Iterable[str]) -> dict[str, int]:
        from kombu.connection import Connection

        out = {}
        with Connection(self.url) as conn:
            channel = conn.channel()
            for name in queues:
                out[name] = channel.queue_declare(queue=name, passive=True).message_count
        return out

    def purge(self, queues: Iterable[str]) -> None:
        from kombu.connection import Connection

        with Connection(self.url) as conn:
            channel = conn.channel()
            for name in queues:
                try:
                    channel.queue_delete(queue=name)
                except Exception:  # noqa: BLE001 - the queue may not exist
                    channel = conn.channel()


def broker_for(url: str, *, quorum: bool = False) -> RedisBroker | AmqpBroker:
    """The broker helper for a URL (``redis://`` or ``amqp://``)."""
    if url.startswith(("amqp://", "pyamqp://")):
        return AmqpBroker(url, quorum=quorum)
    if url.startswith("redis://"):
        return RedisBroker(url)
    raise ValueError(f"unsupported broker URL {url!r}")


def publish_plain(url: str, counts: Mapping[str, int]) -> None:
    """Publish ``counts[q]`` plain Kombu messages ``{"queue": q, "i": n}`` to each queue.

    For programs without Celery (``FairConsumerMixin``); works on every Kombu
    transport, the in-memory one included.
    """
    from kombu.connection import Connection
    from kombu.entity import Queue

    with Connection(url) as conn:
        channel = conn.channel()
        for name in counts:
            Queue(name)(channel).declare()
        producer = conn.Producer(serializer="json")
        for name, count in counts.items():
            for i in range(count):
                producer.publish({"queue": name, "i": i}, routing_key=name, declare=[])
