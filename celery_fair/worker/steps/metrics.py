"""Prometheus metrics (``fair_metrics_port``): an HTTP endpoint in the main process."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from ..build import build_metrics
from ..metrics import MetricsServer
from ..service import FairService
from .errors import one_line_errors

__all__ = ("FairMetricsStep",)

logger = get_logger(__name__)


class FairMetricsStep(bootsteps.StartStopStep):
    """Serves the scheduler's metrics when ``fair_metrics_port`` is set.

    The port is checked at ``__init__`` (a busy port stops the worker at
    start, in one line); the HTTP thread starts in ``start``, after the pool
    has forked, so it lives in the main process only, where the scheduler is.
    """

    name = "celery_fair.metrics"
    requires = ("celery_fair.worker.steps.service:FairWorkerStep",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        service: FairService = w.fair
        self.enabled = service.settings.metrics_port is not None
        self.metrics: MetricsServer | None = None
        if self.enabled:
            with one_line_errors():
                self.metrics = build_metrics(service, hostname=getattr(w, "hostname", None))

    def start(self, w: Any) -> None:
        assert self.metrics is not None
        port = self.metrics.start()
        logger.info(
            "celery-fair: Prometheus metrics on http://%s:%d/metrics",
            _host(self.metrics.addr),
            port,
        )

    def stop(self, w: Any) -> None:
        if self.metrics is not None:
            self.metrics.stop()

    def shutdown(self, w: Any) -> None:
        self.stop(w)


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
