"""What the broker holds for each queue, read without any worker: the exporter's figures.

Redis, per queue: the backlog in every Kombu priority list and, for a keyed
queue, in the per-key lists (``LLEN`` of the queue's own list misses those);
the age of the oldest waiting message found; the messages delivered and not
acknowledged (Kombu's ``unacked`` hash); the messages parked next to the
queue, by cause.  For a keyed queue also the keys with messages waiting, the
keys throttled by their limits, and the largest backlogs (the ``fair.sizes``
sorted set) with the age of each one's oldest message.

Every figure costs a fixed number of broker commands per queue plus one per
top key, sent in pipelines: never a scan of the keyspace.  The one figure
that grows with the load is the unacknowledged count per queue, which reads
Kombu's ``unacked`` hash (one entry per message in flight) in batches of
:data:`UNACKED_BATCH`, and only while it holds at most ``unacked_limit``
entries.

Ages come from the ``fair_published`` header that ``celery_fair.install``
stamps on every task a producer sends: a message of a producer without it
counts in the backlog but has no age.  The age of a keyed queue's oldest
message is the oldest among its unkeyed list, its largest keys and the keys
next in line: a lower bound, exact when those include the oldest.

RabbitMQ, per queue: the messages ready and the consumers (a passive
declare), the parked messages (the ``<queue>.fair-malformed`` queue) and,
given the management plugin's HTTP API, the messages unacknowledged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import compat
from ..keys import throttling
from ..keys.lanes import KeyLanes, first_level
from ..keys.lanes_admin import declared
from ..keys.layout import BACKLOG, KeyedNames
from ..keys.store import text
from ..parked import PARKING_SUFFIX, cause_of, decode_record
from ..scheduling.admission import BrokerMemory
from ..wire import PUBLISHED_HEADER

__all__ = (
    "BrokerMemory",
    "KeyReading",
    "KeyedReading",
    "QueueReading",
    "read_rabbitmq",
    "read_redis",
    "read_redis_memory",
)

#: Entries of Kombu's ``unacked`` hash read per round trip.
UNACKED_BATCH = 1000
#: Parked messages read per queue to count their causes (the rest count as ``unread``).
PARKED_SCAN = 1000


@dataclass(frozen=True)
class KeyReading:
    """One key of a keyed queue: messages waiting, and the oldest one's age (s)."""

    key: str
    backlog: int
    oldest_age: float | None


@dataclass(frozen=True)
class KeyedReading:
    """The keyed part of a queue."""

    #: Keys with messages waiting in line (the unkeyed key included; None: not known,
    #: RabbitMQ, whose shard lanes mix keys).
    active_keys: int | None
    #: Keys throttled now: at their concurrency limit, and by their rate limit (None:
    #: not known to the broker, RabbitMQ, where the workers hold them back).
    throttled: throttling.Throttled | None
    #: The keys with the largest backlogs, largest first.
    top: tuple[KeyReading, ...]
    #: Seconds the key throttled longest has been, now (among ``THROTTLED_SCAN`` keys).
    longest_throttled: float | None = None


@dataclass(frozen=True)
class QueueReading:
    """One queue on the broker."""

    queue: str
    #: Messages waiting on the broker (every priority list and every key).
    backlog: int
    #: Seconds the oldest waiting message found has waited (None: none with a stamp).
    oldest_age: float | None = None
    #: Messages delivered to a worker and not acknowledged (None: not known).
    unacked: int | None = None
    #: Consumers (RabbitMQ; None on Redis, which has no such count).
    consumers: int | None = None
    #: Messages parked next to the queue, by cause (``unread`` beyond the scan).
    parked: dict[str, int] = field(default_factory=dict)
    keyed: KeyedReading | None = None
    #: Messages in the queue's schedule (``fair_eta="broker"``; Redis; None on
    #: RabbitMQ), due or not, not yet moved into the queue: not in ``backlog``.
    scheduled: int | None = None
    #: The keys with the most messages in the schedule (a keyed queue), with their counts.
    scheduled_keys: tuple[tuple[str, int], ...] = ()


def _published(item: Any) -> float | None:
    """The ``fair_published`` stamp of a Kombu Redis payload, or None."""
    if item is None:
        return None
    try:
        payload = json.loads(text(item))
        stamp = payload["headers"][PUBLISHED_HEADER]
    except (ValueError, KeyError, TypeError):
        return None
    return float(stamp) if isinstance(stamp, (int, float)) else None


def _age(now: float, stamp: float | None) -> float | None:
    return None if stamp is None else max(0.0, now - stamp)


def _earliest(stamps: Sequence[float | None]) -> float | None:
    """The earliest of these publish stamps (a key's oldest message over its levels)."""
    known = [t for t in stamps if t is not None]
    return min(known) if known else None


def _oldest(ages: Sequence[float | None]) -> float | None:
    known = [a for a in ages if a is not None]
    return max(known) if known else None


def read_redis_memory(channel: Any) -> BrokerMemory:
    """The memory the Redis of a Kombu channel uses, and its ``maxmemory`` (0: none)."""
    with compat.redis_client(channel) as client:
        return BrokerMemory.from_info(client.info("memory"))


def read_redis(
    channel: Any,
    queues: Sequence[str],
    *,
    top: int = 10,
    unacked_limit: int = 10_000,
    clock: Callable[[], float] = time.time,
) -> list[QueueReading]:
    """Read every queue of ``queues`` from the Redis of a Kombu channel."""
    prefix, sep = compat.key_prefix(channel), compat.key_separator(channel)
    steps = list(compat.priority_steps(channel))
    # A keyed queue's priority levels, named by Kombu's list suffix of each step.
    levels = [compat.queue_key(channel, "", pri) for pri in steps]
    with compat.redis_client(channel) as client:
        pipe = client.pipeline(transaction=False)
        throttled: dict[str, Callable[[Iterator[Any]], throttling.Throttled]] = {}
        for queue in queues:
            for pri in steps:
                plain = prefix + compat.queue_key(channel, queue, pri)
                pipe.llen(plain).lindex(plain, -1)  # the oldest: LPUSH, then RPOP
            names = KeyedNames(prefix + queue, sep)
            pipe.hget(names.state, BACKLOG)
            for level in levels:
                pipe.zcard(names.level(level).active)
            throttled[queue] = throttling.read_throttled(pipe, names)
            pipe.zrevrange(names.sizes, 0, top - 1, withscores=True)
            pipe.zrange(names.active, 0, top - 1)
            parking = prefix + queue + PARKING_SUFFIX
            pipe.llen(parking).lrange(parking, 0, PARKED_SCAN - 1)
            pipe.zcard(names.schedule)
            pipe.zrevrange(names.scheduled_keys, 0, top - 1, withscores=True)
        unacked_key = prefix + compat.unacked_keys(channel)[0]
        pipe.hlen(unacked_key).time()
        replies = iter(pipe.execute())
        raw: dict[str, dict[str, Any]] = {}
        for queue in queues:
            lists = [(int(next(replies)), next(replies)) for _ in steps]
            raw[queue] = {
                "plain": sum(n for n, _ in lists),
                "plain_oldest": [_published(item) for _, item in lists],
                "keyed": int(next(replies) or 0),
                "active": sum(int(next(replies)) for _ in levels),
                "throttled": throttled[queue](replies),
                "sizes": [(text(k), int(n)) for k, n in next(replies)],
                "next": [text(k) for k in next(replies)],
                "parked": int(next(replies)),
                "parked_items": next(replies),
                "scheduled": int(next(replies)),
                "scheduled_keys": tuple((text(k), int(n)) for k, n in next(replies)),
            }
        in_flight = int(next(replies))
        broker_now = throttling.broker_clock(next(replies))  # the clock of the throttling times
        # The oldest message of each key looked at: its list's last item.
        keys_of = {q: _keys_to_look_at(r) for q, r in raw.items()}
        pipe = client.pipeline(transaction=False)
        for queue, keys in keys_of.items():
            names = KeyedNames(prefix + queue, sep)
            for key in keys:
                for level in levels:
                    pipe.lindex(names.level(level).key_list(key), -1)
        stamps = iter(pipe.execute())
        oldest_of = {
            q: {k: _earliest([_published(next(stamps)) for _ in levels]) for k in keys}
            for q, keys in keys_of.items()
        }
        unacked = _unacked_by_queue(client, unacked_key, in_flight, unacked_limit)
    now = clock()
    for found in raw.values():
        found["longest_throttled"] = found["throttled"].longest(broker_now)
    return [_redis_reading(queue, raw[queue], oldest_of[queue], unacked, now) for queue in queues]


def _keys_to_look_at(raw: dict[str, Any]) -> list[str]:
    """The largest keys and the keys next in line (the unkeyed key's list is read apart)."""
    keys = [k for k, _ in raw["sizes"]] + [k for k in raw["next"] if k]
    return list(dict.fromkeys(keys))


def _unacked_by_queue(client: Any, key: str, in_flight: int, limit: int) -> dict[str, int] | None:
    """Messages in flight per routing key (Kombu's records), or None past ``limit``."""
    if in_flight > limit:
        return None
    counts: dict[str, int] = {}
    for _tag, record in client.hscan_iter(key, count=UNACKED_BATCH):
        try:
            routing_key = json.loads(text(record))[2]
        except (ValueError, IndexError, TypeError):
            continue
        if isinstance(routing_key, str):
            counts[routing_key] = counts.get(routing_key, 0) + 1
    return counts


def _redis_reading(
    queue: str,
    raw: dict[str, Any],
    oldest: dict[str, float | None],
    unacked: dict[str, int] | None,
    now: float,
) -> QueueReading:
    parked: dict[str, int] = {}
    for item in raw["parked_items"]:
        cause = cause_of(decode_record(item, queue).reason)
        parked[cause] = parked.get(cause, 0) + 1
    unread = raw["parked"] - len(raw["parked_items"])
    if unread > 0:
        parked["unread"] = unread
    keyed = None
    throttled: throttling.Throttled = raw["throttled"]
    if raw["keyed"] or raw["active"] or throttled.at_limit or throttled.sleeping or raw["sizes"]:
        keyed = KeyedReading(
            active_keys=raw["active"],
            throttled=throttled,
            top=tuple(KeyReading(k, n, _age(now, oldest.get(k))) for k, n in raw["sizes"]),
            longest_throttled=raw["longest_throttled"],
        )
    ages = [_age(now, s) for s in raw["plain_oldest"]] + [_age(now, s) for s in oldest.values()]
    return QueueReading(
        queue=queue,
        backlog=raw["plain"] + raw["keyed"],
        oldest_age=_oldest(ages),
        unacked=None if unacked is None else unacked.get(queue, 0),
        parked=parked,
        keyed=keyed,
        scheduled=raw["scheduled"],
        scheduled_keys=raw["scheduled_keys"],
    )


def read_rabbitmq(
    connection: Any,
    queues: Sequence[str],
    *,
    management: Callable[[str], dict[str, Any] | None] | None = None,
    keyed: Collection[str] = (),
    top_keys: int = 10,
    prioritised: Collection[str] = (),
) -> list[QueueReading]:
    """Read ``queues`` over AMQP (passive declares); ``management(queue)`` adds unacked.

    A queue that does not exist reads as empty (a passive declare of it
    closes the channel, so a new one is opened for the next).  A ``keyed``
    queue is read with its lanes (:mod:`celery_fair.keys.lanes`): its backlog
    and unacked count every lane's.  Its largest keys (``top_keys``) are the
    keys isolated to a noisy lane, each with its lane's backlog (a lane's
    directory names its key), and the unkeyed key with the queue's own; the
    keys sharing a shard lane are not told apart.  The ``prioritised`` keyed queues
    have lanes per priority level, a noisy lane's every level counted for its key.
    """
    readings = []
    lanes = KeyLanes(frozenset(keyed), frozenset(prioritised))
    channel = connection.channel()
    try:
        for queue in queues:
            ready, consumers, channel = _declared(connection, channel, queue)
            parked, _, channel = _declared(connection, channel, queue + PARKING_SUFFIX)
            details = management(queue) if management is not None else None
            unacked = details.get("messages_unacknowledged") if details else None
            by_key: dict[str, int] = {"": ready} if ready else {}
            noisy = set(lanes.noisy_lanes(queue))
            for lane in lanes.lanes(queue) if queue in keyed else ():
                waiting, _, channel = _declared(connection, channel, lane)
                ready += waiting
                first = first_level(queue, lane)  # a noisy lane's directory is its first level's
                if waiting and first in noisy:
                    key, channel = _lane_key(connection, channel, first)
                    if key is not None:
                        by_key[key] = by_key.get(key, 0) + waiting
                more = management(lane) if management is not None else None
                held = more.get("messages_unacknowledged") if more else None
                if isinstance(unacked, int) and isinstance(held, int):
                    unacked += held
            top = sorted(by_key.items(), key=lambda item: (-item[1], item[0]))[:top_keys]
            readings.append(
                QueueReading(
                    queue=queue,
                    backlog=ready,
                    unacked=int(unacked) if isinstance(unacked, int) else None,
                    consumers=consumers,
                    parked={"any": parked} if parked else {},
                    keyed=KeyedReading(
                        active_keys=None,
                        throttled=None,
                        top=tuple(KeyReading(key, n, None) for key, n in top),
                    )
                    if queue in keyed
                    else None,
                )
            )
    finally:
        channel.close()
    return readings


def _lane_key(connection: Any, channel: Any, lane: str) -> tuple[str | None, Any]:
    """The key a producer last gave noisy ``lane`` to (its directory's one message, read
    and put back), and the channel to go on with."""
    directory = KeyLanes.directory(lane)
    waiting, _, channel = declared(connection, channel, directory)
    if not waiting:
        return None, channel
    message = channel.basic_get(directory, no_ack=False)
    if message is None:
        return None, channel
    channel.basic_reject(message.delivery_tag, requeue=True)
    try:
        key = json.loads(message.body)
    except (TypeError, ValueError):
        return None, channel
    return (key if isinstance(key, str) else None), channel


def _declared(connection: Any, channel: Any, queue: str) -> tuple[int, int, Any]:
    """:func:`~celery_fair.keys.lanes_admin.declared`, a queue not declared read as empty."""
    ready, consumers, channel = declared(connection, channel, queue)
    return ready or 0, consumers or 0, channel
