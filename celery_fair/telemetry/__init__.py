"""Per-task scheduling records: the schema, the worker's writer, capture.

Needs the ``telemetry`` extra (pyarrow); its names are imported on first use
so that ``celery-fair ring`` and the other commands work on a base install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__all__ = (
    "OUTCOMES",
    "SCHEMA",
    "TaskRecord",
    "TelemetryWriter",
    "WriterStatistics",
    "records_to_table",
)

_EXPORTS = {
    "OUTCOMES": "celery_fair.telemetry.schema",
    "SCHEMA": "celery_fair.telemetry.schema",
    "TaskRecord": "celery_fair.telemetry.schema",
    "records_to_table": "celery_fair.telemetry.schema",
    "TelemetryWriter": "celery_fair.telemetry.writer",
    "WriterStatistics": "celery_fair.telemetry.writer",
}

if TYPE_CHECKING:
    from celery_fair.telemetry.schema import OUTCOMES, SCHEMA, TaskRecord, records_to_table
    from celery_fair.telemetry.writer import TelemetryWriter, WriterStatistics


__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
