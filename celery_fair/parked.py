"""What a parked message carries: the reason, the time, and the message itself.

A message that no worker can run (its body does not decode, its content type
is not accepted, it is not a task message, or no worker knows its task name)
is *parked*: kept on the broker, next to its queue, until an operator looks
at it (``celery-fair parked QUEUE``), puts it back (``--replay``) or drops it
on purpose (``--purge``).  Plain Celery acknowledges or rejects such a
message, and on Redis (or RabbitMQ without a dead-letter exchange) it is gone.

This module is pure: the record's shape on each broker and the headers that
celery-fair adds, with no I/O.  Redis keeps one JSON record per parked
message in the list ``<queue>.fair-malformed``; RabbitMQ keeps the message
itself, with :data:`REASON_HEADER` and friends added, on a queue of that name
(or dead-letters it when its queue has a dead-letter exchange).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .wire import AT_HEADER, FROM_HEADER, REASON_HEADER, RETURNS_HEADER

__all__ = (
    "CAUSES",
    "NOT_A_MESSAGE",
    "PARKED_HEADERS",
    "PARKED_LOG",
    "PARKING_SUFFIX",
    "ParkedMessage",
    "cause_of",
    "decode_record",
    "encode_record",
    "parking_queue",
)

#: The parking place of queue ``q`` is ``q + PARKING_SUFFIX`` (a Redis list,
#: or a RabbitMQ queue that celery-fair declares).
PARKING_SUFFIX = ".fair-malformed"


#: Headers celery-fair adds when parking; ``--replay`` removes them again.
PARKED_HEADERS = (REASON_HEADER, AT_HEADER, FROM_HEADER, RETURNS_HEADER)

#: The reason given to a payload that is not a Kombu message at all.
NOT_A_MESSAGE = "not a Kombu message (no delivery tag)"

#: Why a message was parked, in one word (a metric label), by how its reason
#: text begins: the texts of :mod:`celery_fair.worker.quarantine`, and
#: :data:`NOT_A_MESSAGE` (the fetch script's).
CAUSES: tuple[tuple[str, str], ...] = (
    ("body does not decode", "undecodable"),
    ("invalid or not accepted", "not-accepted"),
    ("not a task message", "not-a-task"),
    ("unknown task", "unknown-task"),
    ("not a Kombu message", "not-a-message"),
)


def cause_of(reason: str) -> str:
    """The one-word cause of a parked message's reason text (``other`` if none fits)."""
    for start, cause in CAUSES:
        if reason.startswith(start):
            return cause
    return "other"


#: The one log line of a parked message (queue, where it is kept, why).
PARKED_LOG = "celery-fair: message of queue %r parked in %s: %s"

#: Redis: the field that marks a JSON record as a parked-message record.
_MARK = "fair_parked"


def parking_queue(queue: str) -> str:
    """The name of ``queue``'s parking place."""
    return queue + PARKING_SUFFIX


@dataclass(frozen=True)
class ParkedMessage:
    """One parked message, as ``celery-fair parked`` lists it.

    ``payload`` is the message as its transport published it (Redis: Kombu's
    JSON envelope as a dict), or None when it was not a message at all and
    ``raw`` holds what was found.
    """

    reason: str
    parked_at: float | None
    queue: str
    task: str | None = None
    task_id: str | None = None
    payload: Mapping[str, Any] | None = None
    raw: str | None = None

    def age(self, now: float) -> float | None:
        """Seconds since it was parked (None if unknown)."""
        return None if self.parked_at is None else max(0.0, now - self.parked_at)


def encode_record(
    payload: Mapping[str, Any] | None, *, reason: str, parked_at: float, queue: str,
    raw: str | None = None,
) -> str:  # fmt: skip
    """The Redis list item that parks ``payload`` (or a ``raw`` non-message)."""
    record: dict[str, Any] = {_MARK: 1, "reason": reason, "parked_at": parked_at, "queue": queue}
    if payload is not None:
        record["payload"] = payload
    else:
        record["raw"] = raw
    return json.dumps(record)


def decode_record(item: bytes | str, queue: str) -> ParkedMessage:
    """A Redis parking list item as a :class:`ParkedMessage`.

    Accepts the records written by :func:`encode_record` and by the atomic
    fetch script (``raw``), and bare items that an older release moved aside
    as they were.
    """
    text = item.decode("utf-8", "surrogateescape") if isinstance(item, bytes) else item
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict) or _MARK not in record:
        return ParkedMessage(reason="not a Kombu message", parked_at=None, queue=queue, raw=text)
    payload = record.get("payload")
    headers = payload.get("headers") if isinstance(payload, dict) else None
    headers = headers if isinstance(headers, dict) else {}
    parked_at = record.get("parked_at")
    return ParkedMessage(
        reason=str(record.get("reason") or "unknown"),
        parked_at=float(parked_at) if isinstance(parked_at, (int, float)) else None,
        queue=str(record.get("queue") or queue),
        task=_text(headers.get("task")),
        task_id=_text(headers.get("id")),
        payload=payload if isinstance(payload, dict) else None,
        raw=None if isinstance(payload, dict) else _text(record.get("raw")),
    )


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
