"""Producers: what a call declares it holds (``fair_resources``) goes on its message, checked.

``task.apply_async(..., fair_resources={"gpu_mem": 10})`` declares it for
one call.  Celery would pass an option it does not know on to Kombu as a
message property; the app's ``send_task`` (where ``apply_async`` ends) is
wrapped so that the option is taken off the call, checked, and sent in the
:data:`~celery_fair.wire.RESOURCES_HEADER` header.  A bad declaration (an
unknown form, a negative or non-finite amount) raises
:class:`~celery_fair.errors.FairConfigError` at publish, naming the task and
the value, and nothing is sent.  A task attribute
(``@app.task(fair_resources=...)``) is read by the worker, which checks every
registered task's at start; what a worker can hold is the worker's to check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import compat
from ..errors import FairConfigError
from ..scheduling.resources import parse_demand
from ..wire import RESOURCES_HEADER

__all__ = ("OPTION", "declared", "register_app")

#: The per-call option, and the task attribute, that declare what a run holds.
OPTION = "fair_resources"


def declared(value: Any, task_name: str) -> dict[str, float]:
    """A declaration checked for the wire; errors name the task and the value."""
    setting = f"{OPTION} of task {task_name!r}"
    try:
        return parse_demand(value, setting=setting)
    except FairConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other shape is a bad declaration
        raise FairConfigError(f"{setting}: {exc} (got {value!r})") from None


def register_app(app: Any) -> None:
    """Send a call's ``fair_resources`` in a header, checked."""
    compat.wrap_send_task(app, "resources", _stamping)


def _stamping(original: Callable[..., Any], name: str, *args: Any, **options: Any) -> Any:
    value = options.pop(OPTION, None)
    if value is not None:
        headers = dict(options.get("headers") or {})
        headers[RESOURCES_HEADER] = declared(value, name)
        options["headers"] = headers
    return original(name, *args, **options)
