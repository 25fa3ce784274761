"""The parts of a worker's service that its per-task parts read, as a typed Protocol.

The dispatch gate (:mod:`.dispatch`), the task tracker (:mod:`.tracking`),
its observers (:mod:`.observers`) and the pool watchdog (:mod:`.watchdog`)
are built around :class:`celery_fair.worker.service.FairService`; they depend
on this Protocol, not on the service module, so the imports point one way.
It lists parts only: what is done with them is each part's own method.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from .. import compat
from ..scheduling.scheduler import FairScheduler
from .attachment import Attachment
from .live_weights import LaneKeyWeights
from .pauses import PausedKeys
from .queue_map import QueueMap
from .settings import FairSettings
from .shedder import Shedder
from .windows import PrefetchWindows

__all__ = ("SchedulingService",)


class SchedulingService(Protocol):
    """The scheduler of one worker, its lock, and the parts a task's request meets."""

    settings: FairSettings
    scheduler: FairScheduler
    lock: threading.RLock
    probe: compat.Probe
    clock: Callable[[], float]
    shedder: Shedder | None
    pauses: PausedKeys
    #: The consumed queue, and a keyed queue's key, of a request.
    queue_map: QueueMap
    #: The consumer's live channel, cycle and keyed queues.
    attachment: Attachment
    #: Key weights of keyed queues on RabbitMQ, as this worker's buffer applies them.
    lane_key_weights: LaneKeyWeights
    #: The prefetch windows (``fair_prefetch="auto"`` learns from finished tasks).
    prefetch: PrefetchWindows
    #: The gate before the pool, if any (a :class:`~.dispatch.FairGate` or a
    #: :class:`~.capacity.ResourceGate`; typed loosely: both import this module).
    gate: Any
    #: Per-key limits on RabbitMQ: the :class:`~.key_tokens.KeyTokenGate`, or None
    #: (typed loosely: it imports this module).
    tokens: Any
