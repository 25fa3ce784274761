"""The report's transforms: pure ``DataFrame -> DataFrame`` functions.

Each transform opens or closes with a ``select`` naming its columns and uses
Spark's built-in functions only (no Python UDFs), so the same code runs on a
laptop and on a cluster. They compose with ``DataFrame.transform``::

    tasks = raw.transform(normalize, 60.0).cache()
    shares = tasks.transform(queue_shares)
    jain = tasks.transform(served_by_window, "queue").transform(jain_by_window)

``normalize`` is the only transform that reads the telemetry schema; the
others read its output (the "task" columns below).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

__all__ = (
    "PERCENTILES",
    "RAN",
    "codel_rates",
    "hot_keys",
    "jain_by_window",
    "key_shares",
    "latency_percentiles",
    "normalize",
    "queue_shares",
    "recommendations",
    "routing_skew",
    "served_by_window",
    "throughput",
)

#: Outcomes of tasks that ran on the pool (and were charged).
RAN: tuple[str, ...] = ("success", "failure", "retry")
PERCENTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
NO_KEY = "(none)"
#: Relative error of ``percentile_approx`` is 1 / ACCURACY.
ACCURACY = 10_000


def _pct_name(p: float) -> str:
    return f"p{round(p * 100):d}"


def normalize(raw: DataFrame, window_seconds: float = 60.0) -> DataFrame:
    """Telemetry records -> one row per record with derived times and costs.

    ``cost`` is what the scheduler charged: the recorded cost, else the run
    time, else 1 (a count) for tasks that ran; 0 for tasks that never ran.
    ``wait`` is publish -> start (receive -> start when the producer did not
    stamp the message); ``sojourn`` is the buffer sojourn receive -> dispatch
    (receive -> start when dispatch is not recorded, as from Celery events);
    ``transfer`` is publish -> receive. ``window`` is the start of the
    ``window_seconds`` bucket holding the time the task left the worker.
    """
    ran = F.col("outcome").isin(*RAN)
    left_at = F.coalesce("finished", "started", "received")
    return raw.select(
        F.col("task_id"),
        F.col("task_name"),
        F.coalesce("queue", F.lit("(unknown)")).alias("queue"),
        F.coalesce("fair_key", F.lit(NO_KEY)).alias("fair_key"),
        F.col("outcome"),
        ran.alias("ran"),
        F.when(ran, F.coalesce("cost", "runtime", F.lit(1.0))).otherwise(0.0).alias("cost"),
        F.col("target_weight").alias("weight"),
        (F.col("started") - F.coalesce("published", "received")).alias("wait"),
        (F.coalesce("dispatched", "started") - F.col("received")).alias("sojourn"),
        (F.col("received") - F.col("published")).alias("transfer"),
        F.col("runtime"),
        left_at.alias("left_at"),
        (F.floor(left_at / window_seconds) * window_seconds).alias("window"),
        F.col("hostname"),
    )


def queue_shares(tasks: DataFrame) -> DataFrame:
    """Per queue: share of served cost beside the target share from the weights.

    The target weight is the latest one a queue's records carry (weights can
    change at run time); ``target_share`` is it over the sum of the queues'.
    """
    everything = Window.partitionBy()
    per_queue = tasks.groupBy("queue").agg(
        F.count(F.lit(1)).alias("records"),
        F.sum(F.col("ran").cast("long")).alias("served_tasks"),
        F.sum("cost").alias("served_cost"),
        F.max_by("weight", "left_at").alias("target_weight"),
    )
    return per_queue.select(
        "queue",
        "records",
        "served_tasks",
        "served_cost",
        (F.col("served_cost") / F.sum("served_cost").over(everything)).alias("share"),
        "target_weight",
        (F.col("target_weight") / F.sum("target_weight").over(everything)).alias("target_share"),
    ).select(
        "queue",
        "records",
        "served_tasks",
        "served_cost",
        "share",
        "target_weight",
        "target_share",
        (F.col("share") / F.col("target_share")).alias("share_ratio"),
    )


def key_shares(tasks: DataFrame) -> DataFrame:
    """Per queue and fairness key: served cost, its share overall and within its queue."""
    per_key = tasks.groupBy("queue", "fair_key").agg(
        F.count(F.lit(1)).alias("records"),
        F.sum(F.col("ran").cast("long")).alias("served_tasks"),
        F.sum("cost").alias("served_cost"),
    )
    return per_key.select(
        "queue",
        "fair_key",
        "records",
        "served_tasks",
        "served_cost",
        (F.col("served_cost") / F.sum("served_cost").over(Window.partitionBy())).alias("share"),
        (F.col("served_cost") / F.sum("served_cost").over(Window.partitionBy("queue"))).alias(
            "share_in_queue"
        ),
    )


def served_by_window(tasks: DataFrame, by: str = "queue") -> DataFrame:
    """Per time window and ``by`` ("queue" or "fair_key"): tasks and cost served.

    ``weight`` is the queue's target weight for queues and 1 for keys. An
    entity with records but nothing served in a window has ``served_cost`` 0.
    Keys are counted within their queue (``group`` is the queue; for queues
    it is one group), and tasks without a key are left out: fairness between
    keys is a matter inside one keyed queue.
    """
    weight = F.max("weight") if by == "queue" else F.lit(1.0)
    group = F.lit("") if by == "queue" else F.col("queue")
    rows = tasks if by == "queue" else tasks.where(F.col(by) != F.lit(NO_KEY))
    return (
        rows.groupBy("window", group.alias("group"), by)
        .agg(
            F.sum(F.col("ran").cast("long")).alias("served_tasks"),
            F.sum("cost").alias("served_cost"),
            F.coalesce(weight, F.lit(1.0)).alias("weight"),
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


def latency_percentiles(tasks: DataFrame, by: tuple[str, ...] = ("queue",)) -> DataFrame:
    """Per ``by`` group: p50/p95/p99 of wait and buffer sojourn, run-time figures.

    Also ``runtime_p50`` (the service time), ``runtime_p99`` (the worst normal
    task) and ``transfer_p05`` (publish -> receive when the queue is short, the
    round trip estimate), all from ``percentile_approx``.
    """
    ps = list(PERCENTILES)
    stats = tasks.groupBy(*by).agg(
        F.count(F.lit(1)).alias("records"),
        F.percentile_approx("wait", ps, ACCURACY).alias("wait_q"),
        F.percentile_approx("sojourn", ps, ACCURACY).alias("sojourn_q"),
        F.percentile_approx("runtime", [0.5, 0.99], ACCURACY).alias("runtime_q"),
        F.percentile_approx("transfer", 0.05, ACCURACY).alias("transfer_p05"),
    )
    wait = [F.col("wait_q")[i].alias(f"wait_{_pct_name(p)}") for i, p in enumerate(ps)]
    sojourn = [F.col("sojourn_q")[i].alias(f"sojourn_{_pct_name(p)}") for i, p in enumerate(ps)]
    return stats.select(
        *by,
        "records",
        *wait,
        *sojourn,
        F.col("runtime_q")[0].alias("runtime_p50"),
        F.col("runtime_q")[1].alias("runtime_p99"),
        "transfer_p05",
    )


def _rate(outcome: str) -> Column:
    return F.avg((F.col("outcome") == outcome).cast("double"))


def codel_rates(tasks: DataFrame) -> DataFrame:
    """Per queue: fraction of records that were CoDel requeues, rejects, failures."""
    return (
        tasks.groupBy("queue")
        .agg(
            F.count(F.lit(1)).alias("records"),
            F.sum((F.col("outcome") == "codel-requeue").cast("long")).alias("codel_requeues"),
            F.sum((F.col("outcome") == "codel-reject").cast("long")).alias("codel_rejects"),
            _rate("codel-requeue").alias("codel_requeue_rate"),
            _rate("codel-reject").alias("codel_reject_rate"),
            _rate("failure").alias("failure_rate"),
            _rate("retry").alias("retry_rate"),
            _rate("revoked").alias("revoked_rate"),
        )
        .select(
            "queue",
            "records",
            "codel_requeues",
            "codel_rejects",
            "codel_requeue_rate",
            "codel_reject_rate",
            "failure_rate",
            "retry_rate",
            "revoked_rate",
        )
    )


def recommendations(latency: DataFrame, target_fraction: float = 0.1) -> DataFrame:
    """Per queue, from ``latency_percentiles``: prefetch and CoDel settings.

    Prefetch = ceil(round trip / service time), at least 1: enough messages
    in flight to cover one fetch round trip while the pool works ("Some
    queuing theory: throughput, latency and bandwidth"). CoDel interval = the
    worst normal task (p99 run time); target = ``target_fraction`` of it
    (RFC 8289 section 4.4 puts target at 5-10% of interval).
    """
    service = F.greatest(F.col("runtime_p50"), F.lit(1e-6))
    rtt = F.greatest(F.coalesce(F.col("transfer_p05"), F.lit(0.0)), F.lit(0.0))
    return latency.select(
        "queue",
        rtt.alias("round_trip"),
        F.col("runtime_p50").alias("service_time"),
        F.greatest(F.ceil(rtt / service), F.lit(1)).cast("int").alias("recommended_prefetch"),
        (F.col("runtime_p99") * target_fraction).alias("codel_target"),
        F.col("runtime_p99").alias("codel_interval"),
    )


def routing_skew(tasks: DataFrame, shares: DataFrame) -> DataFrame:
    """Per queue: share of arrivals and of distinct keys against the target share.

    Arrivals are records other than CoDel requeues (a requeued task comes
    back and is counted at its final outcome). ``skew`` is arrival share /
    target share - 1: 0 for a router that spreads work by weight.
    """
    everything = Window.partitionBy()
    arrivals = (
        tasks.where(F.col("outcome") != "codel-requeue")
        .groupBy("queue")
        .agg(
            F.count(F.lit(1)).alias("arrivals"),
            F.approx_count_distinct("fair_key").alias("keys"),
        )
    )
    return arrivals.join(shares.select("queue", "target_share"), "queue", "left").select(
        "queue",
        "arrivals",
        (F.col("arrivals") / F.sum("arrivals").over(everything)).alias("arrival_share"),
        "keys",
        (F.col("keys") / F.sum("keys").over(everything)).alias("key_share"),
        "target_share",
        (F.col("arrivals") / F.sum("arrivals").over(everything) / F.col("target_share") - 1).alias(
            "skew"
        ),
    )


def hot_keys(keys: DataFrame, factor: float = 5.0, top: int = 20) -> DataFrame:
    """Keys served ``factor`` times their fair part of their queue, hottest first.

    The fair part of a key is 1 / (keys in its queue). Returns at most ``top``
    rows over all queues, with ``heat`` = share in queue x keys in queue.
    """
    in_queue = Window.partitionBy("queue")
    heated = keys.where(F.col("fair_key") != NO_KEY).select(
        "queue",
        "fair_key",
        "records",
        "served_cost",
        "share",
        "share_in_queue",
        (F.col("share_in_queue") * F.count(F.lit(1)).over(in_queue)).alias("heat"),
    )
    return (
        heated.where(F.col("heat") >= factor)
        .orderBy(F.col("share").desc(), "queue", "fair_key")
        .limit(top)
        .select("queue", "fair_key", "records", "served_cost", "share", "share_in_queue", "heat")
    )
