"""celery-fair: weighted fair queueing for Celery and Kombu.

The public names are imported on first use (PEP 562): ``import celery_fair``
and the pure core (``celery_fair.scheduling``) load nothing of Celery's
worker, Kombu's transports or remote control; :func:`install` does, when a
worker or producer calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__

#: Public name -> the module that defines it.  What a Celery user reaches for;
#: the scheduler's parts (``celery_fair.scheduling``), the worker's
#: (``celery_fair.worker``) and the rest stay importable from their modules.
_EXPORTS: dict[str, str] = {
    "BrokerMemoryHigh": "celery_fair.errors",
    "check": "celery_fair.checking",
    "CompatibilityError": "celery_fair.errors",
    "ConsistentHashRouter": "celery_fair.routing.router",
    "FairConfigError": "celery_fair.errors",
    "FairConfigWarning": "celery_fair.errors",
    "FairConsumerMixin": "celery_fair.kombu.mixin",
    "HashRing": "celery_fair.routing.ring",
    "IsolationPolicy": "celery_fair.routing.isolation",
    "KeyBacklogFull": "celery_fair.errors",
    "MissingRouteKeyError": "celery_fair.routing.router",
    "PublishRefused": "celery_fair.errors",
    "declare_consistent_hash_exchange": "celery_fair.routing.rabbitmq",
    "install": "celery_fair.install",
}

__all__ = (
    "BrokerMemoryHigh",
    "CompatibilityError",
    "ConsistentHashRouter",
    "FairConfigError",
    "FairConfigWarning",
    "FairConsumerMixin",
    "HashRing",
    "IsolationPolicy",
    "KeyBacklogFull",
    "MissingRouteKeyError",
    "PublishRefused",
    "__version__",
    "check",
    "declare_consistent_hash_exchange",
    "install",
)

if TYPE_CHECKING:
    from .checking import check
    from .errors import (
        BrokerMemoryHigh,
        CompatibilityError,
        FairConfigError,
        FairConfigWarning,
        KeyBacklogFull,
        PublishRefused,
    )
    from .install import install
    from .kombu.mixin import FairConsumerMixin
    from .routing.isolation import IsolationPolicy
    from .routing.rabbitmq import declare_consistent_hash_exchange
    from .routing.ring import HashRing
    from .routing.router import ConsistentHashRouter, MissingRouteKeyError


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(__all__)
