"""celery-fair: weighted fair queueing for Celery and Kombu.

The public names are imported on first use (PEP 562): ``import celery_fair``
and the pure core (``celery_fair.scheduling``) load nothing of Celery's
worker, Kombu's transports or remote control; :func:`install` does, when a
worker or producer calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "BrokerMemoryHigh": "celery_fair.errors",
    "ConsistentHashRouter": "celery_fair.routing.router",
    "DeficitRoundRobin": "celery_fair.scheduling.drr",
    "FairConfigError": "celery_fair.errors",
    "FairScheduler": "celery_fair.scheduling.scheduler",
    "KeyBacklogFull": "celery_fair.errors",
    "HashRing": "celery_fair.routing.ring",
    "MissingRouteKeyError": "celery_fair.routing.router",
    "PublishRefused": "celery_fair.errors",
    "declare_consistent_hash_exchange": "celery_fair.routing.rabbitmq",
    "install": "celery_fair.install",
}

__all__ = (
    "BrokerMemoryHigh",
    "ConsistentHashRouter",
    "DeficitRoundRobin",
    "FairConfigError",
    "FairScheduler",
    "HashRing",
    "KeyBacklogFull",
    "MissingRouteKeyError",
    "PublishRefused",
    "__version__",
    "declare_consistent_hash_exchange",
    "install",
)

if TYPE_CHECKING:
    from .errors import BrokerMemoryHigh, FairConfigError, KeyBacklogFull, PublishRefused
    from .install import install
    from .routing.rabbitmq import declare_consistent_hash_exchange
    from .routing.ring import HashRing
    from .routing.router import ConsistentHashRouter, MissingRouteKeyError
    from .scheduling.drr import DeficitRoundRobin
    from .scheduling.scheduler import FairScheduler


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(__all__)
