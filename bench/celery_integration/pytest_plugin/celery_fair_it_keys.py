"""The fairness key of the keyed run: every task is keyed by its name.

``fair_keys = {"celery": task_name}`` on the worker's app and on every app
the tests publish with, so each task name waits in a key list of its own and
the worker serves the names in fair order instead of in publish order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ("fair_keys_for", "task_name")


def task_name(
    name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
) -> str:
    """The key of a task: its name (``f(name, args, kwargs, options)``, a ``fair_keys`` source)."""
    return name


def fair_keys_for(app: Any) -> dict[str, Any]:
    """``fair_keys`` for ``app``: its default queue (the one queue the suite uses), by task name."""
    return {app.conf.task_default_queue: task_name}
