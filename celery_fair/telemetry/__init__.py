"""Per-task scheduling records: the schema, the worker's writer, capture, synthetic data."""

from celery_fair.telemetry.schema import OUTCOMES, SCHEMA, TaskRecord, records_to_table
from celery_fair.telemetry.writer import TelemetryWriter, WriterStatistics

__all__ = (
    "OUTCOMES",
    "SCHEMA",
    "TaskRecord",
    "TelemetryWriter",
    "WriterStatistics",
    "records_to_table",
)
