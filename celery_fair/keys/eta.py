"""Scheduled tasks on the broker (``fair_eta = "broker"``): countdown, eta and retry on Redis.

Celery on Redis delivers a task with a countdown or an eta at once, and the
worker holds it unacknowledged in memory until it is due.  With
``fair_eta = "broker"`` the app's task sender stamps such a task with its
due time (:data:`~celery_fair.wire.DUE_HEADER`, epoch seconds, from the
``eta`` header Celery's protocol 2 writes), and Kombu's Redis ``_put``
(wrapped by :mod:`celery_fair.keys.publish`) puts it in its queue's
schedule, a sorted set by due time (:attr:`KeyedNames.schedule
<celery_fair.keys.layout.KeyedNames.schedule>`), instead of its queue.  The
worker's fetch script moves the due ones into their queue, or their key's
list, before each pop (``lua/promote.lua``).  See docs/scheduled.md.

The decision travels with each message: several apps in one process, with
either setting, publish each as configured.  On RabbitMQ the header is
stamped and ignored (no Redis channel puts the message): Celery's behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from time import time
from typing import Any

from .. import compat
from ..errors import FairConfigError
from ..wire import DUE_HEADER

__all__ = ("ETA_MODES", "due_time", "parse_eta_mode", "register_app")

#: ``fair_eta``: where a task with a future eta waits: in a worker (Celery's
#: behaviour) or on the broker, in its queue's schedule.
ETA_MODES = ("worker", "broker")


def parse_eta_mode(value: Any) -> str:
    """Check ``fair_eta`` (None: ``"worker"``)."""
    if value is None:
        return "worker"
    if value not in ETA_MODES:
        raise FairConfigError(
            f"fair_eta must be one of {', '.join(map(repr, ETA_MODES))}; got {value!r}"
        )
    return str(value)


def register_app(app: Any) -> None:
    """Send ``app``'s tasks with a future eta to their queue's schedule (``fair_eta``).

    Read when ``install`` runs (and again when a worker starts); an invalid
    value makes every send raise the :class:`FairConfigError`.
    """
    try:
        mode = parse_eta_mode(app.conf.get("fair_eta"))
    except FairConfigError as exc:
        compat.wrap_task_sender(app, _refusing(exc), name="eta")
        return
    if mode != "broker":
        compat.wrap_task_sender(app, None, name="eta")  # taken off, if an earlier one was on
        return
    from .publish import wrap_kombu

    wrap_kombu()
    compat.wrap_task_sender(app, _scheduling_sender(app), name="eta")


def _refusing(error: Exception) -> Callable[..., Any]:
    def send(original: Callable[..., Any], *args: Any, **options: Any) -> Any:
        raise error

    return send


def _scheduling_sender(app: Any) -> Callable[..., Any]:
    """A hook around ``app.amqp.send_task_message`` that stamps a future eta's due time."""

    def send(original: Callable[..., Any], producer: Any, name: str, message: Any,
             *args: Any, **options: Any) -> Any:  # fmt: skip
        headers = message[0] if isinstance(message, (tuple, list)) and message else None
        if isinstance(headers, dict):
            due = due_time(headers.get("eta"), app.conf.timezone)
            if due is not None and due > time():
                headers[DUE_HEADER] = due
            else:
                headers.pop(DUE_HEADER, None)
        extra = options.get("headers")
        if isinstance(extra, dict) and DUE_HEADER in extra:
            # A retry passes its request's headers, merged over the message's after
            # this: the first run's due time must not come back with them.
            options["headers"] = {k: v for k, v in extra.items() if k != DUE_HEADER}
        return original(producer, name, message, *args, **options)

    return send


def due_time(eta: Any, timezone: Any = None) -> float | None:
    """An ``eta`` header (ISO 8601 text, or a datetime) in epoch seconds; None if absent or bad.

    A naive eta is read in ``timezone`` (the app's ``timezone`` setting), as
    Celery's worker reads it (``Request.eta``).
    """
    if eta is None:
        return None
    try:
        from celery.utils.time import maybe_iso8601, maybe_make_aware

        moment = maybe_iso8601(eta) if isinstance(eta, str) else eta
        if not isinstance(moment, datetime):
            return None
        return float(maybe_make_aware(moment, timezone).timestamp())
    except (TypeError, ValueError, OverflowError):
        return None
