"""What a test worker ran: one :class:`TaskRecord` per task, read back from the worker's files.

The worker started by :class:`~celery_fair.testing.FairWorker` imports
:mod:`celery_fair.testing.hooks` (Celery's ``--include``), which appends one
JSON line per finished task to a file per process in the directory named by
``$CELERY_FAIR_TEST_RECORD_DIR``.  A file per process needs no lock and works
with any broker and pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ("RECORD_DIR_ENV", "TaskRecord", "read_records")

#: The directory the worker's hooks write their records to.
RECORD_DIR_ENV = "CELERY_FAIR_TEST_RECORD_DIR"


@dataclass(frozen=True)
class TaskRecord:
    """One run of one task, as the worker saw it.

    ``started`` and ``finished`` are wall-clock seconds (``time.time()``) at
    Celery's ``task_prerun`` and ``task_postrun``: every process of one
    machine shares that clock.  ``queue`` is the routing key the message came
    with (the queue's name, with Celery's default routing), ``fair_key`` and
    ``fair_user`` the fairness key and user of a keyed queue (``None``
    elsewhere), ``state`` Celery's final state (``SUCCESS``, ``FAILURE``,
    ``RETRY``...).
    """

    id: str
    name: str
    queue: str | None
    fair_key: str | None
    fair_user: str | None
    worker: str
    pid: int
    started: float
    finished: float
    state: str | None

    @property
    def runtime(self) -> float:
        """Seconds from start to finish."""
        return self.finished - self.started


def read_records(directory: str | Path) -> list[TaskRecord]:
    """Every record written in ``directory`` so far, ordered by start time.

    A line a process is still writing (no newline yet) is left for the next read.
    """
    records = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            raw = json.loads(line)
            records.append(
                TaskRecord(
                    id=str(raw["id"]),
                    name=str(raw["name"]),
                    queue=raw.get("queue"),
                    fair_key=raw.get("fair_key"),
                    fair_user=raw.get("fair_user"),
                    worker=str(raw.get("worker") or ""),
                    pid=int(raw["pid"]),
                    started=float(raw["started"]),
                    finished=float(raw["finished"]),
                    state=raw.get("state"),
                )
            )
    records.sort(key=lambda r: (r.started, r.finished))
    return records
