"""Telemetry (``fair_telemetry_dir``): one writer in the main process, one per pool process."""

from __future__ import annotations

import os
from typing import Any

from celery import bootsteps, signals
from celery.utils.log import get_logger

from ..recorder import MainWriter, PoolRecorder, telemetry_writer
from ..service import FairService

__all__ = ("FairTelemetryStep",)

logger = get_logger(__name__)


class FairTelemetryStep(bootsteps.StartStopStep):
    """Records every task's times and outcome as Parquet, when ``fair_telemetry_dir`` is set.

    ``create`` gives the tracker its main-process writer (opened in ``start``,
    after the pool has forked) before the dispatch step wraps the hand-over,
    and connects the pool's recorder before the prefork pool forks, so every
    pool process (those started later too, ``max_tasks_per_child``) inherits
    its receivers.
    """

    name = "celery_fair.telemetry"
    requires = ("celery_fair.worker.steps.service:FairWorkerStep",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        service: FairService = w.fair
        self.directory = service.settings.telemetry_dir
        self.enabled = self.directory is not None
        self.writer = MainWriter()
        self.recorder: PoolRecorder | None = None

    def create(self, w: Any) -> None:
        service: FairService = w.fair
        directory, hostname = self.directory, getattr(w, "hostname", None)
        assert directory is not None
        service.tracker.writer = self.writer
        self.recorder = PoolRecorder(
            lambda pid: telemetry_writer(directory, hostname, pid),
            hostname=hostname,
            runtime_cost=service.settings.cost == "runtime",
        )
        self.recorder.connect()

    def start(self, w: Any) -> None:
        service: FairService = w.fair
        directory, hostname = self.directory, getattr(w, "hostname", None)
        assert directory is not None
        self.writer.open(lambda: telemetry_writer(directory, hostname, os.getpid()))
        if self.recorder is not None:
            # solo/threads run tasks here, in the main process.
            self.recorder.open(self.writer)
        signals.task_revoked.connect(service.tracker.on_revoked, weak=False)
        signals.task_failure.connect(service.tracker.on_task_failure, weak=False)
        logger.info("celery-fair: telemetry to %s", directory)

    def stop(self, w: Any) -> None:
        self._close(w)

    def shutdown(self, w: Any) -> None:
        self._close(w)

    def _close(self, w: Any) -> None:
        recorder = self.recorder
        if recorder is not None:
            # The pool has stopped: its processes flushed their own records.
            recorder.disconnect()
            recorder.writer = None
        if self.writer.opened:
            tracker = w.fair.tracker
            signals.task_revoked.disconnect(tracker.on_revoked)
            signals.task_failure.disconnect(tracker.on_task_failure)
            stats = self.writer.close()
            logger.info("celery-fair: telemetry (main process) %s", stats or "no records")
