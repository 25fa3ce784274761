"""celery-fair: weighted fair queueing for Celery and Kombu."""

from __future__ import annotations

from .install import install
from .routing import (
    ConsistentHashRouter,
    HashRing,
    MissingRouteKeyError,
    declare_consistent_hash_exchange,
)
from .scheduling.drr import DeficitRoundRobin
from .scheduling.scheduler import FairScheduler
from .worker.settings import FairConfigError

__version__ = "0.1.0"

__all__ = (
    "ConsistentHashRouter",
    "DeficitRoundRobin",
    "FairConfigError",
    "FairScheduler",
    "HashRing",
    "MissingRouteKeyError",
    "__version__",
    "declare_consistent_hash_exchange",
    "install",
)
