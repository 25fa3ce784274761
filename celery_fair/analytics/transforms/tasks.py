"""Task rows: the normalised telemetry, its windows, and usage per window, queue and key."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from celery_fair.telemetry.schema import OUTCOMES

from .validation import any_bad

#: Outcomes of tasks that ran on the pool (and were charged).
RAN: tuple[str, ...] = ("success", "failure", "retry")
NO_KEY = "(none)"


def ratio(numerator: Column, denominator: Column) -> Column:
    """numerator / denominator, null when the denominator is 0 (ANSI mode raises)."""
    return F.when(denominator != 0, numerator / denominator)


def with_totals(df: DataFrame, **totals: Column) -> DataFrame:
    """``df`` with a column per aggregation in ``totals``, each over all of ``df``'s rows.

    A one-row aggregate joined to every row: what a window without a
    partition gives, without moving every row into one partition (Spark
    warns of that, and on a cluster it does not scale out). Meant for small
    ``df`` (a row per queue): the aggregate reads it a second time.
    """
    return df.crossJoin(F.broadcast(df.agg(*(c.alias(n) for n, c in totals.items()))))


@dataclass(frozen=True)
class Windows:
    """The report's time windows: ``count`` of ``seconds`` each, the first the ``first``-th.

    Window i (from 0) starts at (``first`` + i) x ``seconds``, the value of
    ``normalize``'s ``window`` column.
    """

    seconds: float
    first: int
    count: int

    @classmethod
    def spanning(cls, first: float, last: float, seconds: float) -> Windows:
        """The windows holding every time from ``first`` to ``last``."""
        start = math.floor(first / seconds)
        return cls(seconds, start, math.floor(last / seconds) - start + 1)

    def index(self) -> Column:
        """A task row's window, from 0 (as ``normalize`` places it)."""
        return F.floor(F.col("left_at") / self.seconds) - self.first

    def start(self, i: int) -> float:
        """Window ``i``'s start: the same double as ``normalize`` computes."""
        return float(self.first + i) * self.seconds


def normalize(raw: DataFrame, window_seconds: float = 60.0) -> DataFrame:
    """Telemetry records -> one row per record with derived times and costs.

    ``cost`` is what the scheduler charged: the recorded cost, else the run
    time, else 1 (a count) for tasks that ran; 0 for tasks that never ran.
    ``wait`` is publish -> start (receive -> start when the producer did not
    stamp the message); ``sojourn`` is the buffer sojourn receive -> dispatch
    (receive -> start when dispatch is not recorded, as from Celery events);
    ``transfer`` is publish -> receive. ``key_weight`` is the key's weight
    (null in records of schema 1), ``key_throttled`` the seconds its key spent set
    aside by its per-key limits (0 when unknown), ``key_paused`` the seconds it
    was paused (0 when unknown, and in records before schema 4). ``in_flight`` is receive -> finish,
    the time the worker held the task (0 when unknown); ``busy`` its run time
    on the pool (0 for tasks that never ran). ``window`` is the start of the
    ``window_seconds`` bucket holding the time the task left the worker.
    ``priority`` is the message's Celery priority (null without one, and in
    records before schema 3). ``bad``: the record has a value out of range
    (:mod:`.validation`), counted in the usage table's ``bad_records``.

    Only the columns the report reads are kept, so Spark reads no others
    from the files.
    """
    ran = F.col("outcome").isin(*RAN)
    left_at = F.coalesce("finished", "started", "received")
    held = F.col("finished") - F.col("received")
    run = F.coalesce("runtime", F.col("finished") - F.col("started"))
    return raw.select(
        F.col("task_id"),
        F.coalesce("queue", F.lit("(unknown)")).alias("queue"),
        F.coalesce("fair_key", F.lit(NO_KEY)).alias("fair_key"),
        F.col("outcome"),
        ran.alias("ran"),
        F.when(ran, F.coalesce("cost", "runtime", F.lit(1.0))).otherwise(0.0).alias("cost"),
        F.col("target_weight").alias("weight"),
        F.col("key_weight"),
        F.coalesce("key_throttled", F.lit(0.0)).alias("key_throttled"),
        F.coalesce("key_paused", F.lit(0.0)).alias("key_paused"),
        (F.col("started") - F.coalesce("published", "received")).alias("wait"),
        (F.coalesce("dispatched", "started") - F.col("received")).alias("sojourn"),
        (F.col("received") - F.col("published")).alias("transfer"),
        F.col("runtime"),
        # greatest() skips nulls: an unknown interval counts 0, a negative one
        # (clocks of two hosts) too.
        F.greatest(held, F.lit(0.0)).alias("in_flight"),
        F.when(ran, F.greatest(run, F.lit(0.0))).otherwise(0.0).alias("busy"),
        left_at.alias("left_at"),
        window_start(left_at, window_seconds).alias("window"),
        F.col("priority"),
        any_bad().alias("bad"),
    )


def window_start(left_at: Column, window_seconds: float) -> Column:
    """The start of the window of ``window_seconds`` holding ``left_at`` (``normalize``)."""
    return F.floor(left_at / window_seconds) * window_seconds


def _known_outcomes() -> Column:
    """``OUTCOMES`` as an array literal, the table of :func:`_outcome_code`."""
    return F.array(*(F.lit(o) for o in OUTCOMES))


def _outcome_code() -> Column:
    """A task row's outcome as a byte: :func:`_code_of` its name, 0 for any other.

    Any other outcome is counted by no figure, as by name.
    """
    position = F.array_position(_known_outcomes(), F.col("outcome"))
    return F.coalesce(position, F.lit(0)).cast("byte")


def _code_of(outcome: str) -> int:
    """The byte :func:`_outcome_code` gives ``outcome``: its place in ``OUTCOMES`` from 1."""
    return OUTCOMES.index(outcome) + 1


#: The additive figures of a usage row, after the columns naming it.
USAGE_FIGURES = (
    "records", "served_tasks", "served_cost", "in_flight", "busy", "codel_requeues",
    "codel_rejects", "failures", "retries", "revoked", "last_at", "weight", "key_throttled",
    "key_weight", "key_paused", "bad_records",
)  # fmt: skip


def _usage_sums(coded: bool = False) -> list[Column]:
    """The aggregations behind :data:`USAGE_FIGURES`, over task rows.

    ``coded``: the rows carry the outcome as :func:`_outcome_code`'s byte
    (after the shuffle of :func:`keys_and_buckets`) instead of ``outcome``
    and ``ran``: a byte compared per figure, not a string.
    """
    if coded:
        code = F.col("outcome_code")
        ran = code.isin(*(_code_of(o) for o in RAN))

        def is_(outcome: str) -> Column:
            return code == _code_of(outcome)

    else:
        ran = F.col("ran")

        def is_(outcome: str) -> Column:
            return F.col("outcome") == outcome

    def count_of(outcome: str) -> Column:
        return F.sum(is_(outcome).cast("long"))

    return [
        F.count(F.lit(1)).alias("records"),
        F.sum(ran.cast("long")).alias("served_tasks"),
        F.sum("cost").alias("served_cost"),
        F.sum("in_flight").alias("in_flight"),
        F.sum("busy").alias("busy"),
        count_of("codel-requeue").alias("codel_requeues"),
        count_of("codel-reject").alias("codel_rejects"),
        count_of("failure").alias("failures"),
        count_of("retry").alias("retries"),
        count_of("revoked").alias("revoked"),
        F.max("left_at").alias("last_at"),
        F.max_by("weight", "left_at").alias("weight"),
        F.sum("key_throttled").alias("key_throttled"),
        F.max_by("key_weight", "left_at").alias("key_weight"),
        F.sum("key_paused").alias("key_paused"),
        F.sum(F.col("bad").cast("long")).alias("bad_records"),
    ]


def usage_by_window(tasks: DataFrame) -> DataFrame:
    """Per window, queue and fairness key: every additive figure of the report.

    The one aggregation over all the task rows: shares, Jain's index,
    throughput, CoDel rates, routing skew and the noisy-tenant rules are all
    sums of these columns, computed from this small table (windows x keys
    rows) instead of each scanning the data again. ``weight`` is the group's
    latest target weight, with ``last_at`` the time it was seen, and
    ``key_weight`` the key's; ``key_throttled`` the seconds the key spent set
    aside by its per-key limits, ``key_paused`` the seconds it was paused;
    ``bad_records`` the records with a value out of range (see
    :mod:`.validation`).
    """
    return (
        tasks.groupBy("window", "queue", "fair_key")
        .agg(*_usage_sums())
        .select("window", "queue", "fair_key", *USAGE_FIGURES)
    )
