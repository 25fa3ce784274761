"""``celery_fair.install(app)``: add celery-fair to an existing Celery app."""

from __future__ import annotations

import time
import warnings
import weakref
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
    twice is harmless.  A worker refuses invalid settings when it starts; in
    any process, a producer too, install checks them as :func:`celery_fair.check`
    does and issues a :class:`~celery_fair.errors.FairConfigWarning` for an
    invalid one (naming the setting and its value) or an unknown name, without
    raising: the app still boots.  The check is made again when the app's
    configuration is read anew (``config_from_object`` after ``install``);
    each message is issued once per app.  Celery's worker and remote-control
    modules are imported here, not by ``import celery_fair``: a producer or a
    pure-core user does not pay for them.
    """
    from celery.signals import before_task_publish

    from .keys import eta
    from .keys import publish as keys
    from .kombu import admission, resources
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
    # What a call declares it holds (fair_resources), checked, in a header.
    resources.register_app(app)
    _warn_about_settings(app)
    app.on_after_configure.connect(
        _settings_read, sender=app, weak=False, dispatch_uid="celery_fair.settings"
    )
    app.steps["worker"].update(WORKER_STEPS)
    app.steps["consumer"].update(CONSUMER_STEPS)
    options = app.user_options["worker"]
    worker_options = {
        "fair_weights": ("--fair-weights", "Queue weights, e.g. p0=4,p1=8 (overrides the "
                         "fair_weights setting)."),
        "fair_capacity": ("--fair-capacity", "What this worker can hold, e.g. cpu=9,mem=18 "
                          "(overrides the fair_capacity setting)."),
    }  # fmt: skip
    for name, (flag, text) in worker_options.items():
        if not any(getattr(opt, "name", None) == name for opt in options):
            options.add(click.Option([flag], default=None, help=text))
    return app


#: The warnings issued for each app: each once.
_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _settings_read(sender: Any = None, **kwargs: Any) -> None:
    """``app.on_after_configure``: the configuration was (re)read."""
    if sender is not None:
        _warn_about_settings(sender)


def _warn_about_settings(app: Any) -> None:
    """Warn (:class:`FairConfigWarning`) of each setting a worker would refuse or not know."""
    from .checking import check
    from .errors import FairConfigError, FairConfigWarning
    from .keys.publish import producer_settings

    try:
        messages = check(app).warnings
    except FairConfigError as exc:
        then = "a worker refuses to start with it"
        try:
            producer_settings(app.conf)
        except FairConfigError:
            then += ", and every task this app sends raises it"
        messages = [f"celery-fair: invalid setting: {exc} ({then})"]
    except Exception as exc:  # noqa: BLE001 - a check that fails must not stop the app booting
        messages = [f"celery-fair: the fair_* settings could not be checked: {exc!r}"]
    seen = _warned.setdefault(app, set())
    for message in messages:
        if message not in seen:
            seen.add(message)
            warnings.warn(message, FairConfigWarning, stacklevel=3)


def _stamp_published(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """Stamp the producer's wall time, for the publish -> start wait in telemetry."""
    if headers is not None and PUBLISHED_HEADER not in headers:
        headers[PUBLISHED_HEADER] = time.time()
