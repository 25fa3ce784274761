"""Findings: prefetch advice, routing skew, hot, throttled and noisy keys and windows."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from celery_fair.analytics.noisy import DEFAULT_RULES, NoisyRules

from .tasks import NO_KEY, ratio, with_totals

#: Seconds: a publish-to-receive time above this is a wait in a backlog, not a fetch
#: round trip (a fetch from Redis or RabbitMQ takes milliseconds, even across regions).
MAX_ROUND_TRIP = 1.0


def recommendations(latency: DataFrame, target_fraction: float = 0.1) -> DataFrame:
    """Per queue, from ``quantiles.quantiles``: prefetch and CoDel settings.

    Prefetch = ceil(round trip / service time), at least 1: enough messages
    in flight to cover one fetch round trip while the pool works ("Some
    queuing theory: throughput, latency and bandwidth"). The round trip is
    the 5th percentile of publish -> receive; when even that is above
    :data:`MAX_ROUND_TRIP` the queue was backlogged all along, the times
    measure the backlog, and no prefetch is recommended (null: use
    ``fair_prefetch="auto"``, which measures the fetch itself). CoDel
    interval = the worst normal task (p99 run time); target =
    ``target_fraction`` of it (RFC 8289 section 4.4 puts target at 5-10% of
    interval).
    """
    service = F.greatest(F.col("runtime_p50"), F.lit(1e-6))
    rtt = F.greatest(F.coalesce(F.col("transfer_p05"), F.lit(0.0)), F.lit(0.0))
    prefetch = F.greatest(F.ceil(rtt / service), F.lit(1)).cast("int")
    return latency.select(
        "queue",
        rtt.alias("round_trip"),
        F.col("runtime_p50").alias("service_time"),
        F.when(rtt <= MAX_ROUND_TRIP, prefetch).alias("recommended_prefetch"),
        (F.col("runtime_p99") * target_fraction).alias("codel_target"),
        F.col("runtime_p99").alias("codel_interval"),
    )


def routing_skew(keys: DataFrame, shares: DataFrame) -> DataFrame:
    """Per queue: share of arrivals and of distinct keys against the target share.

    Reads ``key_shares`` rows (one per queue and key) and ``queue_shares``.
    Arrivals are records other than CoDel requeues (a requeued task comes
    back and is counted at its final outcome); ``keys`` counts the keys with
    an arrival (tasks without a key are one). ``skew`` is arrival share /
    target share - 1: 0 for a router that spreads work by weight.
    """
    arrived = keys.select(
        "queue", "fair_key", (F.col("records") - F.col("codel_requeues")).alias("arrivals")
    ).where(F.col("arrivals") > 0)
    per_queue = arrived.groupBy("queue").agg(
        F.sum("arrivals").alias("arrivals"),
        F.count(F.lit(1)).alias("keys"),  # a row per key: no distinct
    )
    totals = with_totals(per_queue, all_arrivals=F.sum("arrivals"), all_keys=F.sum("keys"))
    arrival_share = ratio(F.col("arrivals"), F.col("all_arrivals"))
    return totals.join(shares.select("queue", "target_share"), "queue", "left").select(
        "queue",
        "arrivals",
        arrival_share.alias("arrival_share"),
        "keys",
        ratio(F.col("keys"), F.col("all_keys")).alias("key_share"),
        "target_share",
        (ratio(arrival_share, F.col("target_share")) - 1).alias("skew"),
    )


def hot_keys(keys: DataFrame, factor: float = 5.0, top: int = 20) -> DataFrame:
    """Keys served ``factor`` times their fair part of their queue, from ``key_shares``.

    The fair part of a key is 1 / (keys in its queue). Returns at most ``top``
    rows over all queues, with ``heat`` = share in queue x keys in queue.
    """
    heated = keys.where(F.col("fair_key") != NO_KEY).select(
        "queue",
        "fair_key",
        "records",
        "served_cost",
        "share",
        "share_in_queue",
        (F.col("share_in_queue") * F.col("keys_in_queue")).alias("heat"),
    )
    return (
        heated.where(F.col("heat") >= factor)
        .orderBy(F.col("share").desc(), "queue", "fair_key")
        .limit(top)
        .select("queue", "fair_key", "records", "served_cost", "share", "share_in_queue", "heat")
    )


def across_queues(keys: DataFrame, names: list[str]) -> DataFrame:
    """The keys ``names`` over every queue, from ``key_shares``: their share of all work.

    A tenant routed over several queues is a row per queue in ``key_shares``;
    ``share_all_queues`` is the sum of those rows' ``share`` (served cost over
    all served cost), ``queues`` how many queues served it.  Only the keys
    named (the findings'): one small job over the key rows.
    """
    return (
        keys.where(F.col("fair_key").isin(names))
        .groupBy("fair_key")
        .agg(F.sum("share").alias("share_all_queues"), F.count(F.lit(1)).alias("queues"))
    )


def throttled_keys(keys: DataFrame, top: int = 20) -> DataFrame:
    """The ``top`` keys that spent longest set aside by their limits, from ``key_shares``.

    Collected apart from the most served keys: a throttled key is served
    little, by design, and could be missing from those.
    """
    return (
        keys.where(F.col("throttled") > 0)
        .orderBy(F.col("throttled").desc(), "queue", "fair_key")
        .limit(top)
        .select("queue", "fair_key", "throttled", "served_tasks", "weight")
    )


def paused_keys(keys: DataFrame, top: int = 20) -> DataFrame:
    """The ``top`` keys that spent longest paused (``control fair_key_pause``).

    From ``key_shares``.
    """
    return (
        keys.where(F.col("paused") > 0)
        .orderBy(F.col("paused").desc(), "queue", "fair_key")
        .limit(top)
        .select("queue", "fair_key", "paused", "served_tasks", "weight")
    )


def _above_even(share: Column, entities: Column, rules: NoisyRules) -> Column:
    # Null (not flagged) where there is no keyed entity: a window of unkeyed tasks only.
    return share >= ratio(F.lit(rules.excess), entities)


def noisy_keys(keys: DataFrame, rules: NoisyRules = DEFAULT_RULES) -> DataFrame:
    """Keys that broke a whole-report rule of ``rules``, from ``key_shares`` rows.

    One row per flagged (queue, key) with a boolean column per rule. Even
    splits count keys only (tasks without a key are not a tenant).
    """
    counted = keys.select(
        "queue", "fair_key", "served_cost", "share", "share_in_queue", "keys_in_queue",
        "keys_overall",
    )  # fmt: skip
    share, in_queue = F.col("share"), F.col("share_in_queue")
    by_all = (share >= rules.share_of_all) & _above_even(share, F.col("keys_overall"), rules)
    by_queue = (in_queue >= rules.share_of_queue) & _above_even(
        in_queue, F.col("keys_in_queue"), rules
    )
    hot = in_queue * F.col("keys_in_queue") >= rules.hot_factor
    flagged = counted.select(
        "queue",
        "fair_key",
        "served_cost",
        "share",
        "share_in_queue",
        "keys_in_queue",
        F.coalesce(by_all, F.lit(False)).alias("share_of_all"),
        F.coalesce(by_queue, F.lit(False)).alias("share_of_queue"),
        F.coalesce(hot, F.lit(False)).alias("hot_in_queue"),
    )
    return flagged.where(
        (F.col("fair_key") != NO_KEY)
        & (F.col("share_of_all") | F.col("share_of_queue") | F.col("hot_in_queue"))
    )


def window_totals(usage: DataFrame, counts: DataFrame | None = None) -> DataFrame:
    """Per window: in-flight work, processing time and keys, over every queue.

    Reads ``usage_by_window`` rows; on bucketed rows the keys are counted by
    ``counts`` (:func:`keys_by_window` or :func:`key_counts`) instead of the
    rows.
    """
    sums = [F.sum("in_flight").alias("window_in_flight"), F.sum("busy").alias("window_busy")]
    if counts is None:
        return usage.groupBy("window").agg(
            *sums, F.count(F.when(F.col("fair_key") != NO_KEY, 1)).alias("keys_in_window")
        )
    keys = counts.groupBy("window").agg(F.sum("n").alias("keys_in_window"))
    return usage.groupBy("window").agg(*sums).join(keys, "window", "left")


def noisy_windows(
    usage: DataFrame,
    window_seconds: float,
    rules: NoisyRules = DEFAULT_RULES,
    totals: DataFrame | None = None,
) -> DataFrame:
    """Windows in which a key held too much of the in-flight work or processing time.

    The per-window rules of ``rules`` (after Amazon SQS fair queues; see
    :mod:`celery_fair.analytics.noisy`). Reads ``usage_by_window`` rows; one
    row per flagged (window, queue, key)
    with its shares of the window's in-flight work and processing time and a
    boolean per rule. ``totals`` (:func:`window_totals`) are the windows'
    when ``usage`` holds only some of their rows.

    Every rule compares sums with thresholds that do not depend on the row:
    on bucketed rows (:func:`keys_and_buckets`) it flags every bucket that holds
    a noisy key, and the keys inside those buckets are checked next.
    """
    # A window's totals from one small aggregation, joined to the rows that can be
    # flagged at all (a key with min_tasks records): a window function over every
    # usage row would sort them all, and with a million keys they are as many as
    # the records.
    if totals is None:
        totals = window_totals(usage)
    enough = (F.col("records") >= rules.min_tasks) & (F.col("fair_key") != NO_KEY)
    shares = (
        usage.where(enough)
        .join(totals, "window")
        .select(
            "window",
            "queue",
            "fair_key",
            "records",
            (F.col("in_flight") / window_seconds).alias("in_flight_tasks"),
            ratio(F.col("in_flight"), F.col("window_in_flight")).alias("in_flight_share"),
            ratio(F.col("busy"), F.col("window_busy")).alias("processing_share"),
            "keys_in_window",
        )
    )

    def over(share: str, threshold: float) -> Column:
        return (F.col(share) > threshold) & _above_even(
            F.col(share), F.col("keys_in_window"), rules
        )

    held = F.col("in_flight_tasks") >= rules.min_in_flight
    in_flight = enough & held & over("in_flight_share", rules.in_flight_share)
    processing = enough & over("processing_share", rules.processing_share)

    flagged = shares.select(
        "window",
        "queue",
        "fair_key",
        "records",
        "in_flight_tasks",
        "in_flight_share",
        "processing_share",
        F.coalesce(in_flight, F.lit(False)).alias("in_flight"),
        F.coalesce(processing, F.lit(False)).alias("processing_time"),
    )
    return flagged.where(F.col("in_flight") | F.col("processing_time"))
