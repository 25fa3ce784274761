"""What the per-task parts of a worker need of its service, as a typed Protocol.

The dispatch gate (:mod:`.dispatch`) and the task tracker (:mod:`.tracking`)
are built by :class:`celery_fair.worker.service.FairService` and call back
into it; they depend on this Protocol, not on the service module, so the
imports point one way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from .. import compat
from ..keys.serving import KeyedServing
from ..scheduling.scheduler import FairScheduler
from .pauses import PausedKeys
from .settings import FairSettings
from .shedder import Shedder

__all__ = ("SchedulingService",)


class SchedulingService(Protocol):
    """The scheduler of one worker, its lock, and what a task's request maps to."""

    settings: FairSettings
    scheduler: FairScheduler
    lock: threading.RLock
    probe: compat.Probe
    clock: Callable[[], float]
    shedder: Shedder | None
    pauses: PausedKeys

    @property
    def keyed(self) -> KeyedServing | None: ...

    def queue_of(self, request: Any) -> str | None: ...

    def key_of(self, request: Any, queue: str) -> tuple[str | None, int, str | None]: ...

    def observe_service(self, runtime: float) -> None: ...
