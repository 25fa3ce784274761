"""Resources: what each tenant held of the workers' capacity, and its use over time.

Telemetry of schema 6 carries, with resources on, what a task held
(``resources``) and its worker's capacity (``capacity``), both maps of
resource -> amount; the report runs these transforms only when some record
carries a capacity.  They read the telemetry records themselves (not
``normalize`` rows, which leave the maps out so that the usual passes never
read them).

- Held: a task that ran holds each amount for its run time, the interval
  ending when it finished (:func:`held_rows`).  Summed per tenant that is its
  resource-seconds (:func:`tenant_held`), spread over the report's windows by
  how much of the run fell in each (:func:`held_by_window`).
- Capacity: a worker (``hostname``) is counted from its first record's
  receipt to its last record's finish, idle stretches included, with the
  capacity its records carry in each window (the latest one seen, carried to
  the windows without a record: :func:`capacity_by_window`).  Summed over
  workers, capacity-seconds per window and resource.
- Shares (:func:`resource_shares`): a tenant's held resource-seconds over the
  capacity-seconds of the whole report, per resource, and its *dominant
  share*, the largest of those (Ghodsi et al., "Dominant Resource Fairness",
  NSDI 2011).  A queue's own resource (``queue:NAME``, from
  ``fair_queue_concurrency``) is a limit, not a share of the machine: it has
  its share but never dominates, as in ``fair_cost="dominant"``.

Amounts that are null, NaN or below 0 are left out (unknown), as are
capacities of 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from celery_fair.scheduling.resources import QUEUE_RESOURCE

from .tasks import NO_KEY, RAN, ratio, window_start

__all__ = (
    "capacity_by_window",
    "held_by_window",
    "held_rows",
    "resource_shares",
    "resource_usage",
    "tenant_held",
)


def _amount(column: str = "amount") -> Column:
    """Whether an exploded amount counts: known, a number, above 0."""
    c = F.col(column)
    return c.isNotNull() & ~F.isnan(c) & (c > 0)


def _windows(start: Column, end: Column, seconds: float) -> Column:
    """The numbers of the windows of ``seconds`` that the interval start..end overlaps.

    One that ends where a window starts does not reach into it; an empty
    interval is in its start's window.
    """
    first = F.floor(start / seconds)
    return F.sequence(first, F.greatest(first, F.ceil(end / seconds) - 1))


def held_rows(raw: DataFrame) -> DataFrame:
    """Telemetry records -> a row per task that ran and resource it held.

    ``run`` is the task's run time (its ``runtime``, else finished - started;
    0 when unknown), ``end`` when the run ended (``finished``, else started +
    run): the task held ``amount`` of ``resource`` from end - run to end.
    """
    run = F.greatest(F.coalesce("runtime", F.col("finished") - F.col("started")), F.lit(0.0))
    end = F.coalesce("finished", F.col("started") + run)
    ran = F.col("outcome").isin(*RAN) & F.col("resources").isNotNull() & end.isNotNull()
    return (
        raw.where(ran)
        .select(
            F.coalesce("queue", F.lit("(unknown)")).alias("queue"),
            F.coalesce("fair_key", F.lit(NO_KEY)).alias("fair_key"),
            run.alias("run"),
            end.alias("end"),
            F.explode("resources").alias("resource", "amount"),
        )
        .where(_amount())
    )


def tenant_held(held: DataFrame) -> DataFrame:
    """Per queue, key and resource: the resource-seconds held (amount x run time)."""
    return held.groupBy("queue", "fair_key", "resource").agg(
        F.sum(F.col("amount") * F.col("run")).alias("held_seconds")
    )


def held_by_window(held: DataFrame, window_seconds: float) -> DataFrame:
    """Per window and resource: the resource-seconds held in that window.

    A run is spread over the windows it overlaps by how much of it falls in
    each, so a window never holds more than its tasks ran in it.
    """
    w = window_seconds
    start = F.col("end") - F.col("run")
    spans = held.select(
        "resource",
        "amount",
        start.alias("start"),
        "end",
        F.explode(_windows(start, F.col("end"), w)).alias("i"),
    )
    low, high = F.col("i") * w, (F.col("i") + 1) * w
    overlap = F.least(F.col("end"), high) - F.greatest(F.col("start"), low)
    return spans.groupBy((low.cast("double")).alias("window"), "resource").agg(
        F.sum(F.col("amount") * F.greatest(overlap, F.lit(0.0))).alias("held_seconds")
    )


def capacity_by_window(raw: DataFrame, window_seconds: float) -> DataFrame:
    """Per window and resource: the capacity-seconds of every worker seen then.

    A worker is its ``hostname``; it counts from its first record's receipt
    to its last record's finish (idle in between or not), with the capacity
    of its latest record in each window, or the nearest window's when it left
    no record in one.
    """
    w = window_seconds
    since = F.coalesce("received", "started", "finished")
    left_at = F.coalesce("finished", "started", "received")
    seen = raw.where(F.col("capacity").isNotNull() & left_at.isNotNull()).select(
        F.coalesce("hostname", F.lit("(unknown)")).alias("host"),
        since.alias("since"),
        left_at.alias("left_at"),
        "capacity",
    )
    per_window = seen.groupBy("host", window_start(F.col("left_at"), w).alias("window")).agg(
        F.max_by("capacity", "left_at").alias("capacity"),
        F.min("since").alias("since"),
        F.max("left_at").alias("until"),
    )
    hosts = per_window.groupBy("host").agg(
        F.min("since").alias("since"), F.max("until").alias("until")
    )
    grid = hosts.select(
        "host",
        "since",
        "until",
        F.explode(_windows(F.col("since"), F.col("until"), w)).alias("i"),
    ).select("host", "since", "until", (F.col("i") * w).cast("double").alias("window"))
    before = Window.partitionBy("host").orderBy("window")
    after = before.rowsBetween(Window.currentRow, Window.unboundedFollowing)
    filled = grid.join(per_window.select("host", "window", "capacity"), ["host", "window"], "left")
    capacity = F.coalesce(
        F.last("capacity", ignorenulls=True).over(before),
        F.first("capacity", ignorenulls=True).over(after),
    )
    seconds = F.least(F.col("until"), F.col("window") + w) - F.greatest(
        F.col("since"), F.col("window")
    )
    counted = filled.select(
        "window", F.greatest(seconds, F.lit(0.0)).alias("seconds"), capacity.alias("capacity")
    )
    return (
        counted.select("window", "seconds", F.explode("capacity").alias("resource", "amount"))
        .where(_amount())
        .groupBy("window", "resource")
        .agg(F.sum(F.col("amount") * F.col("seconds")).alias("capacity_seconds"))
    )


def resource_usage(held: DataFrame, capacity: DataFrame) -> DataFrame:
    """Per window and resource: held and capacity-seconds, and the share of capacity held.

    ``held`` is :func:`held_by_window`, ``capacity`` :func:`capacity_by_window`
    (of the same window size).  ``held_share`` is null where no capacity was
    seen.
    """
    both = capacity.join(held, ["window", "resource"], "full").select(
        "window",
        "resource",
        F.coalesce("held_seconds", F.lit(0.0)).alias("held_seconds"),
        F.coalesce("capacity_seconds", F.lit(0.0)).alias("capacity_seconds"),
    )
    return both.select(
        "*", ratio(F.col("held_seconds"), F.col("capacity_seconds")).alias("held_share")
    )


def resource_shares(
    held: DataFrame, capacity_seconds: Mapping[str, float], max_keys: int = 100
) -> DataFrame:
    """Per queue (``fair_key`` null) and per key: held resource-seconds, shares, dominant share.

    ``held`` is :func:`tenant_held`; ``capacity_seconds`` the capacity-seconds
    of each resource over the report (the sums of :func:`capacity_by_window`,
    collected: a literal here, not a join). ``held_seconds`` and ``shares``
    are maps of resource -> value; ``dominant_share`` the largest share of a
    resource that is not a queue's own, ``dominant_resource`` that resource.
    Of the keys (tasks without a key are not a key), the ``max_keys`` of each
    queue with the largest dominant share.
    """
    pairs = (F.lit(x) for kv in sorted(capacity_seconds.items()) for x in kv)
    totals = F.create_map(*pairs).cast("map<string,double>")
    per_queue = held.groupBy("queue", "resource").agg(F.sum("held_seconds").alias("held_seconds"))
    queues = per_queue.select(F.lit(None).cast("string").alias("fair_key"), *per_queue.columns)
    keys = held.where(F.col("fair_key") != NO_KEY).select(queues.columns)

    def shares(rows: DataFrame) -> DataFrame:
        share = ratio(F.col("held_seconds"), F.element_at(totals, F.col("resource")))
        dominant = F.when(~F.col("resource").startswith(QUEUE_RESOURCE), F.col("share"))
        return (
            rows.select("*", share.alias("share"))
            .groupBy("queue", "fair_key")
            .agg(
                F.map_from_entries(F.collect_list(F.struct("resource", "held_seconds"))).alias(
                    "held_seconds"
                ),
                F.map_from_entries(F.collect_list(F.struct("resource", "share"))).alias("shares"),
                F.max(dominant).alias("dominant_share"),
                F.max_by(F.when(dominant.isNotNull(), F.col("resource")), dominant).alias(
                    "dominant_resource"
                ),
            )
        )

    rank = F.row_number().over(
        Window.partitionBy("queue").orderBy(
            F.col("dominant_share").desc_nulls_last(), F.col("fair_key")
        )
    )
    top = shares(keys).select("*", rank.alias("rank")).where(F.col("rank") <= max_keys)
    return shares(queues).unionByName(top.drop("rank"))
