"""Consistent-hash routing of task keys: the pure ring, the Celery router, RabbitMQ native mode."""

from celery_fair.routing.isolation import IsolationPolicy, IsolationStatistics, NoisyKeyDetector
from celery_fair.routing.keys import ArgKey, CallableKey, HeaderKey, KwargKey, PropertyKey
from celery_fair.routing.rabbitmq import NativeTopology, declare_consistent_hash_exchange
from celery_fair.routing.ring import HashRing, RingStatistics, ideal_moved_fraction, key_hash
from celery_fair.routing.router import (
    ConsistentHashRouter,
    MissingRouteKeyError,
    RouterStatistics,
)

__all__ = (
    "ArgKey",
    "CallableKey",
    "ConsistentHashRouter",
    "HashRing",
    "HeaderKey",
    "IsolationPolicy",
    "IsolationStatistics",
    "KwargKey",
    "MissingRouteKeyError",
    "NativeTopology",
    "NoisyKeyDetector",
    "PropertyKey",
    "RingStatistics",
    "RouterStatistics",
    "declare_consistent_hash_exchange",
    "ideal_moved_fraction",
    "key_hash",
)
