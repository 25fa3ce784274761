"""``celery_fair.install(app)``: add celery-fair to an existing Celery app."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .wire import PUBLISHED_HEADER

if TYPE_CHECKING:
    from celery import Celery

__all__ = ("install",)

App = TypeVar("App", bound="Celery")


def install(app: App) -> App:
    """Add the celery-fair bootsteps and the ``--fair-weights`` worker option.

    Adds to the app's configuration and never replaces any of it; calling it
    twice is harmless.  Settings are validated when a worker starts.  Celery's
    worker and remote-control modules are imported here, not by ``import
    celery_fair``: a producer or a pure-core user does not pay for them.
    """
    from celery.signals import before_task_publish

    from .keys import eta
    from .keys import publish as keys
    from .kombu import admission
    from .worker import control  # noqa: F401  (registers the remote-control commands)
    from .worker.steps import CONSUMER_STEPS, WORKER_STEPS

    before_task_publish.connect(_stamp_published, weak=False, dispatch_uid="celery_fair.published")
    # Admission before a Redis broker fills (fair_broker_memory_high); put on
    # first, so that it runs after the keys are stamped.
    admission.register_app(app)
    # Keyed queues (fair_keys): the key in a header, the message in its key's list.
    keys.register_app(app)
    # Scheduled tasks on the broker (fair_eta="broker"): a future eta's due time in a header.
    eta.register_app(app)
    app.steps["worker"].update(WORKER_STEPS)
    app.steps["consumer"].update(CONSUMER_STEPS)
    options = app.user_options["worker"]
    if not any(getattr(opt, "name", None) == "fair_weights" for opt in options):
        options.add(
            click.Option(
                ["--fair-weights"],
                default=None,
                help="Queue weights, e.g. p0=4,p1=8 (overrides the fair_weights setting).",
            )
        )
    return app


def _stamp_published(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """Stamp the producer's wall time, for the publish -> start wait in telemetry."""
    if headers is not None and PUBLISHED_HEADER not in headers:
        headers[PUBLISHED_HEADER] = time.time()
