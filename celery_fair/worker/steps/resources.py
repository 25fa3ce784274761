"""The workers' capacities on the broker, read and written on the consumer's timer."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ..capacity import ResourceGate
from ..cluster import BEAT_EVERY, CapacityBoard
from ..service import FairService

__all__ = ("FairResourcesStep",)


class FairResourcesStep(bootsteps.StartStopStep):
    """Resources on (``fair_capacity`` ...): this worker's capacity on the board
    (:mod:`celery_fair.worker.cluster`) every :data:`BEAT_EVERY` seconds."""

    name = "celery_fair.resources"
    requires = ("celery_fair.worker.steps.consumer:FairConsumerStep",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        service: FairService | None = getattr(c.controller, "fair", None)
        self.enabled = service is not None and service.settings.resources
        self._timer: Any = None
        self._board: CapacityBoard | None = None

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        gate = service.gate
        if self._timer is not None or not isinstance(gate, ResourceGate):
            return
        if self._board is None:
            hostname = str(getattr(c, "hostname", None) or getattr(c.controller, "hostname", ""))
            self._board = CapacityBoard(gate, hostname, lambda: service.attachment.channel)
        self._board.beat()
        self._timer = c.timer.call_repeatedly(BEAT_EVERY, self._board.beat)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)
        if self._board is not None:
            self._board.leave()
