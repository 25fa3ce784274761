"""``celery_fair.install(app)``: add celery-fair to an existing Celery app."""

from __future__ import annotations

from typing import Any

import click

from .worker import control  # noqa: F401  (registers the remote-control commands)
from .worker.steps import FairConsumerStep, FairWorkerStep

__all__ = ("install",)


def install(app: Any) -> Any:
    """Add the celery-fair bootsteps and the ``--fair-weights`` worker option.

    Adds to the app's configuration and never replaces any of it; calling it
    twice is harmless.  Settings are validated when a worker starts.
    """
    app.steps["worker"].add(FairWorkerStep)
    app.steps["consumer"].add(FairConsumerStep)
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
