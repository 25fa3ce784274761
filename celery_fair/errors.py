"""The errors celery-fair raises, at the bottom of the package: every layer may raise them."""

from __future__ import annotations

__all__ = ("CompatibilityError", "FairConfigError")


class FairConfigError(ValueError):
    """A ``fair_*`` setting, a ``--fair-*`` option or a command argument has an invalid value.

    The message names the setting and the value.  When ``celery worker``
    starts, the worker's steps turn it into Celery's one-line ``Error: ...``
    (:class:`celery_fair.worker.steps.StartError`) and the worker exits with
    status 1.
    """


class CompatibilityError(FairConfigError):
    """A capability celery-fair cannot do without is missing from these versions.

    Raised by the start-up probes of :mod:`celery_fair.compat`, naming the
    versions of Celery, Kombu and redis-py in use.
    """
