"""Imported inside a test worker (``celery worker --include celery_fair.testing.hooks``).

Records every task the worker runs (see :mod:`celery_fair.testing.records`)
when ``$CELERY_FAIR_TEST_RECORD_DIR`` is set; does nothing otherwise.  The
handlers are connected at import, in the worker's main process before the pool
starts, so every pool process (forked) inherits them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

from celery import signals

from .records import RECORD_DIR_ENV

__all__ = ()

_started: dict[str, float] = {}
_file: dict[int, IO[str]] = {}
#: The threads (and green threads) of one pool process write one line at a time.
_lock = threading.Lock()


def _out(directory: str) -> IO[str]:
    pid = os.getpid()
    handle = _file.get(pid)
    if handle is None:
        handle = _file[pid] = open(  # noqa: SIM115 - one per process, for its lifetime
            Path(directory) / f"{pid}.jsonl", "a", encoding="utf-8"
        )
    return handle


def _on_prerun(task_id: str | None = None, **kwargs: Any) -> None:
    if task_id is not None:
        _started[task_id] = time.time()


def _on_postrun(
    task_id: str | None = None, task: Any = None, state: str | None = None, **kwargs: Any
) -> None:
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory or task_id is None:
        return
    finished = time.time()
    request = getattr(task, "request", None)
    delivery = getattr(request, "delivery_info", None) or {}
    record = {
        "id": task_id,
        "name": getattr(task, "name", None) or "",
        "queue": delivery.get("routing_key"),
        "fair_key": getattr(request, "fair_key", None),
        "fair_user": getattr(request, "fair_user", None),
        "worker": getattr(request, "hostname", None) or "",
        "pid": os.getpid(),
        "started": _started.pop(task_id, finished),
        "finished": finished,
        "state": state,
    }
    line = json.dumps(record) + "\n"
    with _lock:
        out = _out(directory)
        out.write(line)
        out.flush()


if os.environ.get(RECORD_DIR_ENV):
    signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="celery_fair.testing.pre")
    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_fair.testing.post")
