"""Send a message back to its queue as a copy that counts its returns.

``basic.reject(requeue=True)`` cannot change a message, so it cannot count
how often the message came back; a count is what stops a message from
bouncing between slow consumers for ever.  A return is therefore a copy with
the header :data:`REQUEUE_HEADER` incremented, published before the original
is acknowledged: a crash between the two leaves a duplicate, never a loss.

On Redis the copy goes to the *front* of its list, where the next BRPOP of
any consumer takes it (it keeps its place in line); on the other transports
it is published again and joins the back of the queue.

:func:`requeue` is the one send-back path: the worker's CoDel shedder, its
paused keys and its unknown tasks (:mod:`celery_fair.worker.quarantine`), and
:class:`~celery_fair.kombu.FairConsumerMixin`'s CoDel all carry out a
:class:`~celery_fair.scheduling.dispatch.SendBack` through it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .. import compat
from ..keys.lanes import is_lane
from ..keys.publish import level_of, message_key, message_user, names_for
from ..keys.store import enqueue
from ..scheduling.dispatch import SendBack
from ..wire import MAX_BACKLOG_HEADER, PUBLISHED_HEADER, REQUEUE_HEADER

__all__ = (
    "copy_properties",
    "producer_on",
    "push_front_redis",
    "push_redis",
    "put_payload",
    "requeue",
    "requeue_count",
    "return_copy",
)


#: The AMQP basic properties a copy keeps (the transport's own are dropped).
_PROPERTIES = (
    "correlation_id", "reply_to", "priority", "expiration", "message_id",
    "timestamp", "type", "user_id", "app_id", "delivery_mode",
)  # fmt: skip


def requeue_count(headers: Mapping[str, Any] | None) -> int:
    """The :data:`REQUEUE_HEADER` of ``headers`` (0 if absent or malformed)."""
    try:
        return max(0, int((headers or {}).get(REQUEUE_HEADER) or 0))
    except (TypeError, ValueError):
        return 0


def copy_properties(message: Any) -> dict[str, Any]:
    """The publish properties of ``message`` worth keeping on its copy."""
    properties = {
        k: v for k, v in (message.properties or {}).items() if k in _PROPERTIES and v is not None
    }
    properties.setdefault("delivery_mode", 2)
    return properties


def push_redis(message: Any, queue: str, headers: Mapping[str, Any], *, front: bool) -> bool:
    """Redis: put a copy of ``message`` with ``headers`` added back on ``queue``.

    ``front``: where the next fetch takes it (it keeps its place in line);
    else at the back, as a new publish.  Returns False, doing nothing, on any
    other transport.
    """
    channel: Any = getattr(message, "channel", None)
    raw = compat.raw_payload(message)
    if raw is None or not compat.can_push_front(channel):
        return False
    payload = json.loads(json.dumps(raw))  # a deep copy
    payload.setdefault("headers", {}).update(headers)
    put_payload(channel, queue, payload, front=front)
    return True


def push_front_redis(message: Any, queue: str, headers: Mapping[str, Any]) -> bool:
    """Redis: put a copy of ``message`` with ``headers`` added where BRPOP takes next."""
    return push_redis(message, queue, headers, front=True)


def put_payload(channel: Any, queue: str, payload: dict[str, Any], *, front: bool) -> None:
    """Redis: put a Kombu envelope on ``queue``, in its priority list or its key's list.

    Kombu publishes with LPUSH and fetches with BRPOP (the right end), so
    RPUSH puts the payload first in line and LPUSH last.  The payload gets a
    new delivery tag, as Kombu gives every published message (it keys the
    unacknowledged index; a copy must not share the original's).
    """
    payload.setdefault("properties", {})["delivery_tag"] = str(uuid.uuid4())
    key = message_key(payload, queue)
    with compat.redis_client(channel) as client:
        if key is not None:
            level = level_of(channel, payload)  # back to its own priority level
            names = names_for(channel, queue)
            user = message_user(payload)  # back to its user's list (two-level keys)
            published = (payload.get("headers") or {}).get(PUBLISHED_HEADER)
            order = float(published) if isinstance(published, (int, float)) else None
            enqueue(
                client, names, key, json.dumps(payload), front=front, level=level,
                user=user, order=order if front else None,
            )  # fmt: skip
        else:
            priority = compat.message_priority(channel, payload)
            push = client.rpush if front else client.lpush
            push(compat.key_prefix(channel) + compat.queue_key(channel, queue, priority),
                 json.dumps(payload))  # fmt: skip


def producer_on(channel: Any) -> Any:
    """A Kombu producer on ``channel`` that declares nothing."""
    from kombu.messaging import Producer

    return Producer(channel, auto_declare=False)


def return_copy(
    message: Any, queue: str | None, headers: Mapping[str, Any], *, front: bool
) -> None:
    """Send a copy of ``message`` with ``headers`` added back to ``queue``.

    Redis: onto ``queue``, at the front or the back (see :func:`push_redis`).
    Other transports: published on the message's own channel through the
    default exchange, which routes by queue name on every transport, so the
    copy reaches this queue only, whatever else its exchange is bound to; it
    joins the back of the queue.  A task delivered from a lane of keyed
    ``queue`` on RabbitMQ goes back to that lane: the lanes of its key and
    its priority level, not the queue itself, where every level's tasks wait
    in one priority order (:mod:`celery_fair.keys.lanes`).  (Without a known
    ``queue``, to the exchange and routing key it came with.)  The caller
    acknowledges the original afterwards: a crash between the two leaves a
    duplicate, never a loss.
    """
    if queue is not None and push_redis(message, queue, headers, front=front):
        return
    merged = dict(message.headers or {})
    # A received task's copy is not counted in its key's backlog counter on
    # RabbitMQ (a copy sent back is never refused: celery_fair.keys.backlog_counter):
    # without the cap, its receipt frees no place that another task holds.  A
    # caller whose task never freed its place gives the cap back in ``headers``.
    merged.pop(MAX_BACKLOG_HEADER, None)
    merged.update(headers)
    info = message.delivery_info or {}
    came = info.get("routing_key")
    if queue is not None and isinstance(came, str) and is_lane(queue, came):
        queue = came
    producer_on(message.channel).publish(
        message.body,
        exchange="" if queue is not None else info.get("exchange") or "",
        routing_key=queue if queue is not None else info.get("routing_key"),
        headers=merged,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        **copy_properties(message),
    )


def requeue(
    message: Any,
    back: SendBack,
    *,
    log: logging.Logger,
    failure: str,
    args: tuple[object, ...] = (),
    ack: Callable[[], object] | None = None,
    reject: Callable[..., object] | None = None,
) -> bool:
    """Carry out ``back`` on ``message``: True if it left, False if it is still here.

    A copy goes to ``back.queue`` (:func:`return_copy`), then the original is
    acknowledged with ``ack`` (default ``message.ack``; a Celery request's
    ``acknowledge`` keeps the worker's own account); ``back.dead_letter``
    rejects it without requeue instead (``reject``, default
    ``message.reject``).  Copy first, ack second: a crash between the two
    leaves a duplicate, never a loss.  Any failure is logged on ``log`` as
    ``failure % args`` with the exception, and False returned: the caller
    keeps the message, to run it or to try again, and counts the failure.
    """
    try:
        if back.dead_letter:
            (reject or message.reject)(requeue=False)
        else:
            return_copy(message, back.queue, back.headers, front=back.front)
            (ack or message.ack)()
    except Exception:  # noqa: BLE001 - the caller keeps it: a task kept is not lost
        log.warning(failure, *args, exc_info=True)
        return False
    return True
