"""What a worker is attached to right now: the task consumer's channel and its cycle.

Shared by the service's collaborators (:mod:`.keyed_admin`, :mod:`.live_weights`,
:mod:`.windows`), which act through the live channel; replaced at every
(re)connection by :meth:`celery_fair.worker.service.FairService.attach`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..keys.serving import KeyedServing
from ..kombu.atomic import AtomicFetch
from ..kombu.cycle import DWRRCycle

__all__ = ("Attachment",)


@dataclass
class Attachment:
    """The consumer's current channel, its DWRR cycle and the keyed queues it serves."""

    #: The task consumer's current channel (None before the first connection).
    channel: Any = None
    #: The DWRR cycle installed on it (None on a push transport).
    cycle: DWRRCycle | None = None
    #: Keyed queues (``fair_keys``, or a keyed backlog found on a consumed queue).
    keyed: KeyedServing | None = None

    @property
    def fetch(self) -> AtomicFetch | None:
        """The channel's atomic fetch, if it has one."""
        return self.cycle.atomic if self.cycle is not None else None
