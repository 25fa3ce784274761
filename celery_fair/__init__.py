"""celery-fair: weighted fair queueing for Celery and Kombu."""

from __future__ import annotations

from .install import install
from .scheduling.drr import DeficitRoundRobin
from .scheduling.scheduler import FairScheduler
from .worker.settings import FairConfigError

__version__ = "0.1.0"

__all__ = (
    "DeficitRoundRobin",
    "FairConfigError",
    "FairScheduler",
    "__version__",
    "install",
)
