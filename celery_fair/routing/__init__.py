"""Consistent-hash routing of task keys: the pure ring, the Celery router, RabbitMQ native mode.

Names are imported on first use, so that the pure parts (the ring, the
noisy-key thresholds the report shares) load without Celery or Kombu.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

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

_EXPORTS = {
    "IsolationPolicy": "celery_fair.routing.isolation",
    "IsolationStatistics": "celery_fair.routing.isolation",
    "NoisyKeyDetector": "celery_fair.routing.isolation",
    "ArgKey": "celery_fair.routing.keys",
    "CallableKey": "celery_fair.routing.keys",
    "HeaderKey": "celery_fair.routing.keys",
    "KwargKey": "celery_fair.routing.keys",
    "PropertyKey": "celery_fair.routing.keys",
    "NativeTopology": "celery_fair.routing.rabbitmq",
    "declare_consistent_hash_exchange": "celery_fair.routing.rabbitmq",
    "HashRing": "celery_fair.routing.ring",
    "RingStatistics": "celery_fair.routing.ring",
    "ideal_moved_fraction": "celery_fair.routing.ring",
    "key_hash": "celery_fair.routing.ring",
    "ConsistentHashRouter": "celery_fair.routing.router",
    "MissingRouteKeyError": "celery_fair.routing.router",
    "RouterStatistics": "celery_fair.routing.router",
}

if TYPE_CHECKING:
    from celery_fair.routing.isolation import (
        IsolationPolicy,
        IsolationStatistics,
        NoisyKeyDetector,
    )
    from celery_fair.routing.keys import ArgKey, CallableKey, HeaderKey, KwargKey, PropertyKey
    from celery_fair.routing.rabbitmq import NativeTopology, declare_consistent_hash_exchange
    from celery_fair.routing.ring import HashRing, RingStatistics, ideal_moved_fraction, key_hash
    from celery_fair.routing.router import (
        ConsistentHashRouter,
        MissingRouteKeyError,
        RouterStatistics,
    )

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
