"""Shares, fairness and throughput per window, per queue and per key."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from .tasks import NO_KEY, Windows, ratio, with_totals


def queue_shares(usage: DataFrame) -> DataFrame:
    """Per queue: share of served cost beside the target share from the weights.

    Reads ``usage_by_window`` rows. The target weight is the latest one a
    queue's records carry (weights can change at run time); ``target_share``
    is it over the sum of the queues'.
    """
    per_queue = usage.groupBy("queue").agg(
        F.sum("records").alias("records"),
        F.sum("served_tasks").alias("served_tasks"),
        F.sum("served_cost").alias("served_cost"),
        F.max_by("weight", "last_at").alias("target_weight"),
    )
    totals = with_totals(
        per_queue, all_cost=F.sum("served_cost"), all_weight=F.sum("target_weight")
    )
    return totals.select(
        "queue",
        "records",
        "served_tasks",
        "served_cost",
        ratio(F.col("served_cost"), F.col("all_cost")).alias("share"),
        "target_weight",
        ratio(F.col("target_weight"), F.col("all_weight")).alias("target_share"),
    ).select(
        "queue",
        "records",
        "served_tasks",
        "served_cost",
        "share",
        "target_weight",
        "target_share",
        ratio(F.col("share"), F.col("target_share")).alias("share_ratio"),
    )


def keys_by_window(totals: DataFrame, windows: Windows) -> DataFrame:
    """Per window and queue: the number of distinct fairness keys, exactly.

    Reads :func:`key_totals` rows made with ``windows`` (the keys of each
    window, summed from the keys' ``present`` bits). The rows of
    :func:`key_counts`, for windows where the queue had a key.
    """
    cells = F.explode(
        F.array(*(
            F.struct(F.lit(windows.start(i)).alias("window"), F.col(f"n{i}").alias("n"))
            for i in range(windows.count)
        ))
    )  # fmt: skip
    return (
        totals.select("queue", cells.alias("cell"))
        .select(F.col("cell.window").alias("window"), "queue", F.col("cell.n").alias("n"))
        .where(F.col("n") > 0)
    )


def key_shares(usage: DataFrame) -> DataFrame:
    """Per queue and fairness key: served cost, its share overall and within its queue.

    Reads ``usage_by_window`` rows; :func:`shares_by_key` has the columns.
    """
    per_key = usage.groupBy("queue", "fair_key").agg(
        F.sum("records").alias("records"),
        F.sum("served_tasks").alias("served_tasks"),
        F.sum("served_cost").alias("served_cost"),
        F.sum("codel_requeues").alias("codel_requeues"),
        F.sum("key_throttled").alias("throttled"),
        F.sum("key_paused").alias("paused"),
        F.max_by("key_weight", "last_at").alias("weight"),
    )
    return per_key.transform(shares_by_key)


def _key_weight() -> Column:
    """A key row's weight: its recorded one, else 1; null for tasks without a key."""
    return F.when(F.col("fair_key") != NO_KEY, F.coalesce("weight", F.lit(1.0)))


def key_totals(per_key: DataFrame, windows: Windows | None = None) -> DataFrame:
    """Per queue, from one row per queue and key: the totals :func:`shares_by_key` divides by.

    ``queue_cost``, ``keys_in_queue`` (tasks without a key are not a key)
    and ``queue_weight`` per queue; ``all_cost`` and ``keys_overall`` over
    every queue. With ``windows``, the rows of :func:`key_rows` carry
    ``present`` and the column ``n<i>`` counts the keys with a task in
    window i (what :func:`keys_by_window` spreads into rows): one
    aggregation over the keys for both.
    """
    keyed = F.col("fair_key") != NO_KEY
    bits = [] if windows is None else [
        F.sum(F.when(keyed, F.shiftright("present", i).bitwiseAND(1))).alias(f"n{i}")
        for i in range(windows.count)
    ]  # fmt: skip
    # Totals per queue (a few rows), not window functions over the keys: those
    # would sort every key's row into one partition per queue (or, over all
    # queues, move them all to one), and with a million keys that was most of
    # the table's cost.
    per_queue = per_key.groupBy("queue").agg(
        F.sum("served_cost").alias("queue_cost"),
        F.count(F.when(keyed, 1)).alias("keys_in_queue"),
        F.sum(_key_weight()).alias("queue_weight"),
        *bits,
    )
    return with_totals(per_queue, all_cost=F.sum("queue_cost"), keys_overall=F.sum("keys_in_queue"))


def shares_by_key(per_key: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """The ``key_shares`` table from one row per queue and key (:func:`key_rows`).

    ``keys_in_queue`` counts the fairness keys of the queue (tasks without a
    key are not a key), ``keys_overall`` those of every queue. ``weight`` is
    the key's latest weight (1 when the records do not carry it);
    ``target_in_queue`` is it over the sum of the weights of the queue's
    keys: the share weighted fairness gives the key while every key of the
    queue has work waiting (a key that is often idle gets less and leaves its
    part to the others). ``throttled`` is the seconds the key spent set aside by
    its per-key limits, ``paused`` the seconds it was paused;
    ``codel_requeues`` feeds :func:`routing_skew`.

    ``totals`` are :func:`key_totals` of ``per_key``, when already made.
    """
    rows = per_key.select(
        "queue", "fair_key", "records", "served_tasks", "served_cost", "codel_requeues",
        "throttled", "paused", _key_weight().alias("weight"),
        # Only a keyed queue's fetch stamps the key's weight (SERVED_HEADER).
        F.col("weight").isNotNull().alias("keyed"),
    )  # fmt: skip
    if totals is None:
        totals = per_key.transform(key_totals)
    return rows.join(F.broadcast(totals), "queue").select(
        "queue",
        "fair_key",
        "records",
        "served_tasks",
        "served_cost",
        ratio(F.col("served_cost"), F.col("all_cost")).alias("share"),
        ratio(F.col("served_cost"), F.col("queue_cost")).alias("share_in_queue"),
        "keys_in_queue",
        "keys_overall",
        "weight",
        ratio(F.col("weight"), F.col("queue_weight")).alias("target_in_queue"),
        "throttled",
        "paused",
        "codel_requeues",
        "keyed",
    )


def top_keys(keys: DataFrame, per_queue: int = 100) -> DataFrame:
    """The ``per_queue`` keys of each queue that were served most, from ``key_shares``.

    What the report keeps per key: with a million keys, collecting all of
    them would cost more than computing them.
    """
    rank = F.row_number().over(
        Window.partitionBy("queue").orderBy(F.col("served_cost").desc(), "fair_key")
    )
    return keys.select("*", rank.alias("rank")).where(F.col("rank") <= per_queue).drop("rank")


def served_by_window(usage: DataFrame, by: str = "queue") -> DataFrame:
    """Per time window and ``by`` ("queue" or "fair_key"): tasks and cost served.

    Reads ``usage_by_window`` rows. ``weight`` is the queue's target weight,
    or the key's weight (1 when the records do not carry it). An entity with
    records but nothing served in a window has ``served_cost`` 0. Keys are
    counted within their queue (``group`` is the queue; for queues it is one
    group), and tasks without a key are left out: fairness between keys is a
    matter inside one keyed queue.
    """
    if by == "fair_key":
        # Usage rows are one per window, queue and key already: no grouping, which
        # with a million keys would shuffle as many rows as there are records.
        return usage.where(F.col("fair_key") != F.lit(NO_KEY)).select(
            "window",
            F.col("queue").alias("group"),
            F.col("fair_key").alias("entity"),
            "served_tasks",
            "served_cost",
            F.coalesce("key_weight", F.lit(1.0)).alias("weight"),
        )
    return (
        usage.groupBy("window", F.lit("").alias("group"), by)
        .agg(
            F.sum("served_tasks").alias("served_tasks"),
            F.sum("served_cost").alias("served_cost"),
            F.coalesce(F.max("weight"), F.lit(1.0)).alias("weight"),
        )
        .select(
            "window",
            "group",
            F.col(by).alias("entity"),
            "served_tasks",
            "served_cost",
            "weight",
        )
    )


def jain_by_window(served: DataFrame) -> DataFrame:
    """Jain's fairness index per window (and group), over ``served_by_window`` rows.

    J = (sum x)^2 / (n * sum x^2) with x = served cost / weight over the n
    entities present in the window (Jain, Chiu & Hawe, 1984): 1 when every
    entity gets exactly its weighted share, 1/n when one gets everything.
    Over keys, a key present but idle for part of a window lowers the index
    though the scheduler was fair to it: read it beside the key shares.
    For keys, one index per queue and window: the keys of one keyed queue.
    """
    x = F.col("served_cost") / F.col("weight")
    per_window = served.groupBy("window", "group").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum(x).alias("sum_x"),
        F.sum(x * x).alias("sum_x2"),
    )
    return per_window.select(
        "window",
        F.col("group").alias("queue"),
        "n",
        F.when(
            F.col("sum_x2") > 0, F.col("sum_x") * F.col("sum_x") / (F.col("n") * F.col("sum_x2"))
        ).alias("jain"),
    )


def throughput(served: DataFrame, window_seconds: float) -> DataFrame:
    """Per window and entity: tasks and cost served per second."""
    return served.select(
        "window",
        "entity",
        (F.col("served_tasks") / window_seconds).alias("tasks_per_second"),
        (F.col("served_cost") / window_seconds).alias("cost_per_second"),
    )


def codel_rates(usage: DataFrame) -> DataFrame:
    """Per queue: fraction of records that were CoDel requeues, rejects, failures.

    Reads ``usage_by_window`` rows.
    """
    per_queue = usage.groupBy("queue").agg(
        *(
            F.sum(c).alias(c)
            for c in ("records", "codel_requeues", "codel_rejects", "failures", "retries")
        ),
        F.sum("revoked").alias("revoked"),
    )
    records = F.col("records")
    return per_queue.select(
        "queue",
        "records",
        "codel_requeues",
        "codel_rejects",
        ratio(F.col("codel_requeues"), records).alias("codel_requeue_rate"),
        ratio(F.col("codel_rejects"), records).alias("codel_reject_rate"),
        ratio(F.col("failures"), records).alias("failure_rate"),
        ratio(F.col("retries"), records).alias("retry_rate"),
        ratio(F.col("revoked"), records).alias("revoked_rate"),
    )
