"""The worker's first celery-fair step: validate the settings, create the service."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from ... import compat
from ..build import build
from ..settings import FairSettings, unknown_settings
from .errors import one_line_errors

__all__ = ("FairWorkerStep",)

logger = get_logger(__name__)


class FairWorkerStep(bootsteps.Step):
    """Validates the settings and creates the worker's :class:`FairService` (``w.fair``).

    Runs after the pool is created; the other celery-fair steps require it,
    and Celery's ``__init__`` of every step runs before any step's ``create``,
    so they find ``w.fair`` in their own ``__init__``.
    """

    name = "celery_fair.worker"
    requires = ("celery.worker.components:Pool",)

    def __init__(
        self,
        w: Any,
        fair_weights: str | None = None,
        fair_capacity: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(w, **kwargs)
        with one_line_errors():
            settings = FairSettings.from_conf(
                w.app.conf, cli_weights=fair_weights, cli_capacity=fair_capacity
            )
            for message in unknown_settings(w.app.conf):
                logger.warning(message)
            w.fair = build(
                w.app,
                settings,
                concurrency=compat.pool_slots(w),
                hostname=getattr(w, "hostname", None),
            )
            # Before the consumer connects: Kombu's Redis transport restores at its
            # first poll (other transports never call it).
            compat.skip_restores_while_full(w.fair.full.restore_skipped)
            # Queues declared at start and by remote control, while the broker is full.
            full = w.fair.full
            compat.declare_while_full(full.size_outside, full.bind_later, full.refresh_skipped)

    def create(self, w: Any) -> None:
        with one_line_errors():
            compat.probe_worker(w, w.fair.probe)
        w.fair.pool_forgets_running = compat.pool_forgets_running_tasks(getattr(w, "pool", None))
