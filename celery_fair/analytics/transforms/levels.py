"""Priority levels: waits per level, and the keys' shares within each level.

Only records with a priority (telemetry schema 3) count; the report runs these
transforms only when some record has one.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from .tasks import ratio

#: The wait quantiles the report gives per level.
LEVEL_QUANTILES = (0.5, 0.99)


def waits_by_priority(tasks: DataFrame) -> DataFrame:
    """Per queue and priority: tasks that ran, and their publish -> start wait p50, p99.

    Reads ``normalize`` rows.  Approximate percentiles (1% relative error), one
    aggregation over the tasks with a priority.
    """
    ran = tasks.where(F.col("ran") & F.col("priority").isNotNull())
    quantiles = F.percentile_approx("wait", list(LEVEL_QUANTILES), 100)
    return (
        ran.groupBy("queue", "priority")
        .agg(F.count(F.lit(1)).alias("tasks"), quantiles.alias("q"), F.sum("cost").alias("cost"))
        .select(
            "queue",
            "priority",
            "tasks",
            "cost",
            F.col("q")[0].alias("wait_p50"),
            F.col("q")[1].alias("wait_p99"),
        )
    )


def key_shares_by_priority(tasks: DataFrame, max_keys: int) -> DataFrame:
    """Per queue and priority, each key's share of the level's served cost (top ``max_keys``).

    The share is within the level: the keys of one level sum to 1.
    """
    ran = tasks.where(F.col("ran") & F.col("priority").isNotNull())
    per_key = ran.groupBy("queue", "priority", "fair_key").agg(
        F.count(F.lit(1)).alias("tasks"), F.sum("cost").alias("cost")
    )
    level = Window.partitionBy("queue", "priority")
    ranked = Window.partitionBy("queue", "priority").orderBy(F.desc("cost"), "fair_key")
    return (
        per_key.select(
            "queue",
            "priority",
            "fair_key",
            "tasks",
            "cost",
            ratio(F.col("cost"), F.sum("cost").over(level)).alias("share"),
            F.row_number().over(ranked).alias("rank"),
        )
        .where(F.col("rank") <= max_keys)
        .drop("rank")
    )
