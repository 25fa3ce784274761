"""Producers: what a task holds (``fair_resources``) goes on its message, checked.

``task.apply_async(..., fair_resources={"gpu_mem": 10})`` declares it for
one call.  Celery passes an option it does not know on to Kombu as a message
property; the ``before_task_publish`` receiver here takes it off the
properties, checks it, and writes it in the
:data:`~celery_fair.wire.RESOURCES_HEADER` header (a retry keeps the first
call's, which comes back in its headers).  A bad declaration (an unknown
form, a negative or non-finite amount) raises
:class:`~celery_fair.errors.FairConfigError` at publish, naming the task and
the value.  A task attribute (``@app.task(fair_resources=...)``) is read by
the worker, which checks every registered task's at start; what a worker
can hold is the worker's to check.
"""

from __future__ import annotations

from typing import Any

from ..errors import FairConfigError
from ..scheduling.resources import parse_demand
from ..wire import RESOURCES_HEADER

__all__ = ("OPTION", "declared", "stamp_resources")

#: The per-call option, and the task attribute, that declare what a run holds.
OPTION = "fair_resources"


def declared(value: Any, task_name: str) -> dict[str, float] | None:
    """A declaration checked for the wire (None: none); errors name the task."""
    if value is None:
        return None
    return parse_demand(value, setting=f"{OPTION} of task {task_name!r}")


def stamp_resources(
    sender: Any = None, headers: Any = None, properties: Any = None, **_: Any
) -> None:
    """``before_task_publish``: the call's ``fair_resources`` from the properties to a header.

    The signal is sent just before Celery publishes, with the very header and
    property dicts it then publishes (``AMQP.send_task_message``, Celery
    5.3-5.7).  Raises :class:`FairConfigError` for a bad declaration, so the
    task is not sent.
    """
    value = properties.pop(OPTION, None) if isinstance(properties, dict) else None
    if not isinstance(headers, dict):
        return
    if value is None:
        value = headers.get(RESOURCES_HEADER)
        if value is None:
            return
    try:
        headers[RESOURCES_HEADER] = declared(value, str(sender))
    except FairConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other shape is a bad declaration
        raise FairConfigError(f"{OPTION} of task {sender!r}: {exc} (got {value!r})") from None
