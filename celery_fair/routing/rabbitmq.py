"""Declare RabbitMQ's ``x-consistent-hash`` exchange from the router's queue -> weight mapping.

This is the broker-side alternative to ``ConsistentHashRouter``: RabbitMQ's
``rabbitmq_consistent_hash_exchange`` plugin picks the queue. The plugin (3.8
and later) gives each binding as many buckets as its binding key says,
numbers the buckets in binding order, and maps a message to a bucket with
jump consistent hashing (Lamport & Veach, arXiv:1406.2294, 2014) of its
routing key, of the ``hash-header`` header or of the ``hash-property``
property. Shares follow the weights, but removing a queue renumbers the
buckets after its own, and the order of bindings (which a broker restart may
change) is part of the mapping; a message without the hashed header or
property goes to one fixed bucket. The producer-side router has none of these
weaknesses; this function is for deployments that want the broker to route.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from celery_fair.routing.ring import HashRing

__all__ = (
    "HASH_PROPERTIES",
    "NativeTopology",
    "binding_points",
    "declare_consistent_hash_exchange",
)

EXCHANGE_TYPE = "x-consistent-hash"
#: The properties the plugin can hash on (``hash-property``).
HASH_PROPERTIES = ("message_id", "correlation_id", "timestamp")


@dataclass(frozen=True)
class NativeTopology:
    """What ``declare_consistent_hash_exchange`` declared: the exchange and queue -> buckets."""

    exchange: Exchange
    queues: tuple[Queue, ...]
    bindings: Mapping[str, int]


def binding_points(
    queues: Mapping[str, float] | Iterable[str] | HashRing, *, points_per_weight: float = 1
) -> dict[str, int]:
    """Turn weights into the plugin's integer binding keys (``weight * points_per_weight``).

    The plugin's shares are exact for integer bucket counts, so a weight that
    does not scale to a whole number >= 1 is an error rather than rounded.
    """
    if isinstance(points_per_weight, bool) or not (
        isinstance(points_per_weight, (int, float))
        and math.isfinite(points_per_weight)
        and points_per_weight > 0
    ):
        raise ValueError(f"points_per_weight={points_per_weight!r}: must be a positive number")
    ring = queues if isinstance(queues, HashRing) else HashRing(queues)
    points: dict[str, int] = {}
    for name, weight in ring.weights.items():
        scaled = weight * points_per_weight
        whole = round(scaled)
        if whole < 1 or not math.isclose(scaled, whole, rel_tol=1e-9, abs_tol=1e-9):
            raise ValueError(
                f"weight {weight:g} of queue {name!r} times points_per_weight="
                f"{points_per_weight!r} is {scaled:g}, not a whole number >= 1"
            )
        points[name] = whole
    return points


def declare_consistent_hash_exchange(
    channel_or_connection: Any,
    exchange: str,
    queues: Mapping[str, float] | Iterable[str] | HashRing,
    *,
    hash_header: str | None = None,
    hash_property: str | None = None,
    durable: bool = True,
    points_per_weight: float = 1,
) -> NativeTopology:
    """Declare an ``x-consistent-hash`` exchange, its queues, and one weighted binding each.

    ``queues`` is the same mapping (or list) that ``ConsistentHashRouter``
    takes. Without ``hash_header``/``hash_property`` the plugin hashes the
    routing key; ``hash_header="fair_key"`` hashes the header the router
    stamps; ``hash_property`` is one of ``message_id``, ``correlation_id``,
    ``timestamp``. The two are mutually exclusive, as in the plugin.

    Bindings are declared in queue-name order, so two deployments with the
    same configuration get the same bucket numbering. Each queue must have
    one binding only: to change a weight, unbind the old binding first.
    ``channel_or_connection`` is a ``kombu.Connection`` or a channel.
    """
    if not isinstance(exchange, str) or not exchange:
        raise ValueError(f"exchange={exchange!r}: must be a non-empty string")
    if hash_header is not None and hash_property is not None:
        raise ValueError(
            f"hash_header={hash_header!r} and hash_property={hash_property!r} are mutually "
            "exclusive (the plugin hashes one or the other)"
        )
    arguments: dict[str, str] = {}
    if hash_header is not None:
        if not isinstance(hash_header, str) or not hash_header:
            raise ValueError(f"hash_header={hash_header!r}: must be a non-empty string")
        arguments["hash-header"] = hash_header
    if hash_property is not None:
        if hash_property not in HASH_PROPERTIES:
            raise ValueError(
                f"hash_property={hash_property!r}: must be one of {', '.join(HASH_PROPERTIES)}"
            )
        arguments["hash-property"] = hash_property
    points = binding_points(queues, points_per_weight=points_per_weight)
    # kombu has no type hints; the untyped calls below are the whole of its use.
    ex = Exchange(exchange, type=EXCHANGE_TYPE, durable=durable, arguments=arguments or None)  # type: ignore[no-untyped-call]
    declared = tuple(
        Queue(name, exchange=ex, routing_key=str(points[name]), durable=durable)  # type: ignore[no-untyped-call]
        for name in sorted(points)
    )
    if isinstance(channel_or_connection, Connection):
        with channel_or_connection.channel() as channel:  # type: ignore[no-untyped-call]
            _declare(channel, ex, declared)
    else:
        _declare(channel_or_connection, ex, declared)
    return NativeTopology(exchange=ex, queues=declared, bindings=points)


def _declare(channel: Any, exchange: Exchange, queues: tuple[Queue, ...]) -> None:
    exchange.declare(channel=channel)  # type: ignore[no-untyped-call]
    for queue in queues:
        # Queue.declare declares the queue and binds it with its routing key (the points).
        queue.declare(channel=channel)  # type: ignore[no-untyped-call]
