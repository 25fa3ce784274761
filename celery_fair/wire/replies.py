"""The fetch script's replies (``lua/fetch.lua``), as named records.

The script answers with a flat Redis array whose shape says what happened;
:func:`decode_fetch` reads it once, into one of four records, so that no
caller counts fields or indexes them:

* :class:`Message`: ``{key, item}``, a message popped from a list;
* :class:`KeyedMessage`: ``{key, item, "key", fair key, key weight, seconds
  throttled, level suffix, user, seconds paused}``, a message of a keyed queue,
  with what its :class:`~celery_fair.wire.served.Served` record needs;
* :class:`Malformed`: ``{key, item, "malformed"}``, a payload that is not a
  Kombu message, moved aside to the queue's parking list by the script;
* :class:`Idle`: nil, or the milliseconds until a key throttled by its
  limits may go on: every queue was empty.

A fetch that asked for a batch gets an array of the first three kinds
instead, read by :func:`decode_fetched`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from .served import Served

__all__ = (
    "FetchReply",
    "Idle",
    "KeyedMessage",
    "Malformed",
    "Message",
    "Popped",
    "decode_fetch",
    "decode_fetched",
    "text",
)


def text(value: Any) -> str:
    """A Redis reply as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Popped:
    """What the script popped: every reply but :class:`Idle` starts with these two."""

    #: The list it came from (its Redis name, prefixed).
    key: str
    #: The payload as Redis returned it (bytes from a client without decoding).
    item: Any


@dataclass(frozen=True)
class Message(Popped):
    """A message popped from the list ``key``."""


@dataclass(frozen=True)
class KeyedMessage(Popped):
    """A message of the keyed queue ``key``, served as ``fair_key``."""

    fair_key: str
    #: The key's weight when it was served.
    weight: float
    #: Seconds the key spent throttled (set aside by its limits) since its previous task.
    throttled: float
    #: The priority level's list suffix (``""``: the first level).
    level: str
    #: The user served within a two-level key (``""`` for a one-level key).
    user: str
    #: Seconds the key had been paused since its previous task.
    paused: float

    def served(self, charge: float) -> Served:
        """The record stamped on this message, with the ``charge`` asked at fetch."""
        return Served(
            key=self.fair_key,
            charge=charge,
            weight=self.weight,
            throttled=self.throttled,
            level=self.level,
            user=self.user,
            paused=self.paused,
        )


@dataclass(frozen=True)
class Malformed(Popped):
    """A payload of the list ``key`` that is not a message: the script parked it."""


@dataclass(frozen=True)
class Idle:
    """Nothing fetched; ``due``: seconds until a key throttled may go on (None: no such key)."""

    due: float | None


FetchReply: TypeAlias = Message | KeyedMessage | Malformed | Idle

#: The word at a reply's third place that names its kind.
_KEYED, _MALFORMED = "key", "malformed"


def decode_fetch(reply: Any) -> FetchReply:
    """The record of one fetch script reply, as redis-py returns it.

    An empty reply or a number is :class:`Idle` (only a positive number is a
    wait: the script adds 1 to the milliseconds it rounds down).  A reply is
    told apart by the word the script puts after the payload; without one it
    is a plain message.
    """
    if not reply or isinstance(reply, int):
        return Idle(reply / 1000.0 if isinstance(reply, int) and reply > 0 else None)
    key, item = text(reply[0]), reply[1]
    kind = text(reply[2]) if len(reply) > 2 else None
    if kind == _MALFORMED:
        return Malformed(key, item)
    if kind == _KEYED:
        # Numbers come as text or, when Lua kept a number, as a Redis integer.
        return KeyedMessage(
            key=key,
            item=item,
            fair_key=text(reply[3]),
            weight=float(reply[4]),
            throttled=float(reply[5]),
            level=text(reply[6]),
            user=text(reply[7]),
            paused=float(reply[8]),
        )
    return Message(key, item)


def decode_fetched(reply: Any) -> Idle | tuple[Message | KeyedMessage | Malformed, ...]:
    """The records of a fetch script reply, one entry or a batch (an array of entries).

    :class:`Idle` when nothing was fetched, else the messages in the order the
    script took them.
    """
    if reply and isinstance(reply, list) and isinstance(reply[0], list):
        entries = tuple(decode_fetch(entry) for entry in reply)
        if any(isinstance(e, Idle) for e in entries):
            raise ValueError(f"a fetch batch holds an empty entry: {reply!r}")
        return entries  # type: ignore[return-value]  # no Idle, checked above
    one = decode_fetch(reply)
    return one if isinstance(one, Idle) else (one,)
