"""The per-task scheduling record and its Arrow schema (no Celery import here).

Times are ``float64`` seconds since the Unix epoch (``time.time()``), not
Arrow timestamps: the worker gets them from ``time.time()`` without a
conversion, Celery's events carry them in that form, and the report does
arithmetic on them (waits, windows) without time-zone or unit questions. A
time that is not known is null.

A record is written when a task leaves the worker, whatever the outcome:

``published``   when the producer stamped the message (null if it did not)
``received``    when the worker took the message from the broker
``dispatched``  when the worker handed it to the pool (left the fair buffer)
``started``     when the task body began (in the pool process)
``finished``    when the task body ended, or when the worker let go of a task
                that never ran (CoDel requeue/reject, revoked)
``runtime``     the task's run time as Celery measures it (seconds)
``key_weight``  a task of a keyed queue: its key's weight when it was fetched
``key_throttled`` a task of a keyed queue: the seconds its key had spent
                throttled (set aside by its per-key limits) since the key's previous task was
                fetched (0 when it was not; summed over a key's records, the
                time it spent at its limits)
``priority``    the message's Celery priority as published (null without one;
                on Redis 0 is served first, on RabbitMQ the highest number)
``key_user``    a task of a queue with two-level keys: its user within its key
                (``fair_key``); null for a one-level key
``key_paused``  a task of a keyed queue: the seconds its key had been paused
                (``control fair_key_pause``) since the key's previous task was
                fetched (0 when it was not; summed over a key's records, the
                time it spent paused)
``resources``   what one run of the task held on its worker (``fair_resources``
                as the worker read it: ``slots`` always, and ``queue:NAME``
                under ``fair_queue_concurrency``), resource -> amount; null
                when the worker does not share resources, and for a task that
                never reached the pool
``capacity``    the worker's whole capacity when the task went to the pool (or
                left the worker), resource -> amount, ``slots`` included;
                null when the worker does not share resources

``resources`` and ``capacity`` are Arrow ``map<string, double>``: Parquet
stores a map natively, Spark reads it as ``MAP<STRING, DOUBLE>`` and takes it
apart with built-in functions (``explode``, ``map_keys``, ``col[name]``),
where JSON text would be parsed again in every pass; and names come and go
with deployments, so a column per resource would not do.

Derived in the report: wait = started - published (received when published
is null); buffer sojourn = dispatched - received (CoDel's sojourn).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

__all__ = (
    "AMOUNTS",
    "FIELDS",
    "RENAMED_COLUMNS",
    "OUTCOMES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TaskRecord",
    "records_to_table",
)

#: 2 added ``key_weight`` and ``key_held``, 3 ``priority``, 4 ``key_user`` and
#: ``key_paused``, 5 renamed ``key_held`` to ``key_throttled`` ("held" is kept
#: for the tasks a worker holds), 6 added ``resources`` and ``capacity``
#: (resources, maps of resource -> amount); files of an earlier version read
#: the columns they lack as null, and ``key_held`` as ``key_throttled``
#: (:data:`RENAMED_COLUMNS`).
SCHEMA_VERSION = 6

#: The Arrow type of ``resources`` and ``capacity``: resource name -> amount.
AMOUNTS = pa.map_(pa.string(), pa.float64())

#: Columns of earlier schema versions under their current names (old -> new).
RENAMED_COLUMNS: dict[str, str] = {"key_held": "key_throttled"}

#: The outcomes a record may carry. Only the first three ran on the pool.
OUTCOMES: tuple[str, ...] = (
    "success",
    "failure",
    "retry",
    "codel-requeue",
    "codel-reject",
    "revoked",
)


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """What the worker knows about one task when it lets go of it."""

    task_id: str
    task_name: str
    queue: str | None
    outcome: str
    received: float | None
    finished: float | None
    routing_key: str | None = None
    fair_key: str | None = None
    published: float | None = None
    dispatched: float | None = None
    started: float | None = None
    runtime: float | None = None
    cost: float | None = None
    target_weight: float | None = None
    key_weight: float | None = None
    key_throttled: float | None = None
    hostname: str | None = None
    pid: int | None = None
    source: str = "worker"
    priority: int | None = None
    key_user: str | None = None
    key_paused: float | None = None
    #: Resource -> amount (a mapping, or (name, amount) pairs as the recorder writes it).
    resources: Mapping[str, float] | tuple[tuple[str, float], ...] | None = None
    capacity: Mapping[str, float] | tuple[tuple[str, float], ...] | None = None


SCHEMA = pa.schema(
    [
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("task_name", pa.string()),
        pa.field("queue", pa.string()),
        pa.field("outcome", pa.string(), nullable=False),
        pa.field("received", pa.float64()),
        pa.field("finished", pa.float64()),
        pa.field("routing_key", pa.string()),
        pa.field("fair_key", pa.string()),
        pa.field("published", pa.float64()),
        pa.field("dispatched", pa.float64()),
        pa.field("started", pa.float64()),
        pa.field("runtime", pa.float64()),
        pa.field("cost", pa.float64()),
        pa.field("target_weight", pa.float64()),
        pa.field("key_weight", pa.float64()),
        pa.field("key_throttled", pa.float64()),
        pa.field("hostname", pa.string()),
        pa.field("pid", pa.int32()),
        pa.field("source", pa.string()),
        pa.field("priority", pa.int32()),
        pa.field("key_user", pa.string()),
        pa.field("key_paused", pa.float64()),
        pa.field("resources", AMOUNTS),
        pa.field("capacity", AMOUNTS),
    ],
    metadata={"celery_fair.schema_version": str(SCHEMA_VERSION)},
)

#: Field names, in schema order (the same as :class:`TaskRecord`'s).
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TaskRecord))


#: A record's values as a tuple, in :data:`FIELDS` order.  A tuple of strings,
#: numbers and None is untracked by Python's cyclic garbage collector once it
#: survives a collection; a record object stays tracked, and tens of thousands
#: of buffered records make every full collection of a worker slower.
as_row: Callable[[TaskRecord], tuple[Any, ...]] = operator.attrgetter(*FIELDS)


def rows_to_table(rows: Sequence[tuple[Any, ...]]) -> pa.Table:
    """Build an Arrow table in :data:`SCHEMA` from :func:`as_row` tuples."""
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in FIELDS]
    return pa.Table.from_pydict(
        {name: list(values) for name, values in zip(FIELDS, columns, strict=True)},
        schema=SCHEMA,
    )


def records_to_table(records: list[TaskRecord]) -> pa.Table:
    """Build an Arrow table in :data:`SCHEMA` from records (column by column)."""
    return rows_to_table([as_row(r) for r in records])
