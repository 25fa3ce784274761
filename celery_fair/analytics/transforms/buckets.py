"""Very many keys: a row per key over the report and per window, queue and bucket of keys."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from .tasks import (
    NO_KEY,
    USAGE_FIGURES,
    Windows,
    _outcome_code,
    _usage_sums,
    ratio,
    window_start,
)  # fmt: skip

#: Prefix of the bucket labels :func:`keys_and_buckets` puts in place of keys.
BUCKET = "(bucket) "
#: Independent signs per key in :func:`keys_and_buckets` (sketches of the sum of squares).
SIGNS = 4
#: Windows one ``present`` mask of :func:`keys_and_buckets` holds (the
#: automatic window size gives at most about 60).
MASK_BITS = 64
#: The ``grain`` of :func:`keys_and_buckets` rows: one per key over the
#: report, or one per window, queue and bucket of keys.
GRAIN_KEY, GRAIN_BUCKET = "key", "bucket"


def _key_hash() -> Column:
    """A task row's 64-bit hash of (queue, key): its bucket and its signs."""
    return F.xxhash64("queue", "fair_key")


def key_bucket(buckets: int) -> Column:
    """A task row's bucket of keys: a 64-bit hash of (queue, key) mod ``buckets``.

    Null for tasks without a key. The hash's low bits choose the bucket,
    bits 32 and up the signs of :func:`keys_and_buckets`.
    """
    return F.when(F.col("fair_key") != NO_KEY, F.pmod(_key_hash(), F.lit(buckets)))


#: The task columns :func:`keys_and_buckets` shuffles: the ones both of its
#: aggregations read. ``window`` is derived from ``left_at`` after the
#: shuffle; the outcome figures count ``outcome_code``.
_SHUFFLED = (
    "queue", "fair_key", "key_bucket", "outcome_code", "cost", "in_flight", "busy",
    "left_at", "weight", "key_throttled", "key_weight", "key_paused", "bad",
)  # fmt: skip


def keys_and_buckets(
    tasks: DataFrame, buckets: int, windows: Windows, partitions: int, masked: bool = True
) -> DataFrame:
    """Task rows -> a row per key over the report, and per window, queue and bucket of keys.

    For very many keys, where a row per window and key would be about a
    row per record. The task rows are shuffled once, by queue and bucket
    (``partitions`` parts), and two aggregations read that one shuffle:

    - ``grain`` :data:`GRAIN_KEY`: per queue and key over the report, the
      per-key figures (``fair_key`` is the key; ``window`` null). With
      ``masked`` (at most :data:`MASK_BITS` windows), bit i of ``present``
      says the key had a task in window i, which :func:`key_totals`
      counts: an OR per task into a 64-bit word instead of a distinct
      count per window.
    - ``grain`` :data:`GRAIN_BUCKET`: per window, queue and bucket of keys
      (``key_bucket``, from :func:`key_bucket`; ``fair_key`` is
      :data:`BUCKET` and its number), the rows of :func:`usage_by_window`
      with at most ``buckets`` rows per window and queue. Every figure that
      sums over keys stays exact. Tasks without a key keep :data:`NO_KEY`.

    Both aggregations read every shuffled column, so Spark plans one
    exchange and reuses it for the second (``ReusedExchange``): a column read
    by one of them only would give each its own shuffle of every task row.
    Both rows carry every column of :data:`USAGE_FIGURES`.

    The ``key_x*`` columns of bucket rows feed Jain's index over keys:
    ``key_x`` sums the tasks' cost over their key's weight, and each of the
    :data:`SIGNS` columns ``key_x<j>`` the same with a sign drawn from the
    key's hash: a bucket's signed sum, squared, estimates the sum of its
    keys' squared totals (the CountSketch estimate of the second moment:
    Charikar, Chen & Farach-Colton, 2002), and the mean over independent
    signs divides the estimate's variance by their number.
    """
    if masked and windows.count > MASK_BITS:
        raise ValueError(f"{windows.count} windows: at most {MASK_BITS} fit one mask")
    # A string per task is about a sixth of a shuffled row: the outcome goes as
    # a byte, and the figures count the byte (comparing it, not a name rebuilt
    # from it, took 0.6 s less of 10 at 10M records, 1M keys). The other
    # columns are plain references: an alias of a column as itself would stay
    # in one side's plan only, and the two exchanges would no longer be the
    # same one.
    new = {"key_bucket": key_bucket(buckets), "outcome_code": _outcome_code()}
    columns = [c for c in _SHUFFLED if c not in new]
    shuffled = tasks.select(*columns, *(col.alias(name) for name, col in new.items()))
    shuffled = shuffled.repartition(partitions, "queue", "key_bucket")
    keyed = F.col("fair_key") != NO_KEY
    window = window_start(F.col("left_at"), windows.seconds)

    # shiftleft() takes a literal shift in the Python API, the SQL function a column.
    bit = F.call_function("shiftleft", F.lit(1).cast("long"), windows.index().cast("int"))
    present = F.bit_or(bit) if masked else F.lit(None).cast("long")
    per_key = shuffled.groupBy("queue", "key_bucket", "fair_key").agg(
        *_usage_sums(coded=True), present.alias("present")
    )

    # The hash again after the shuffle, rather than one more shuffled column.
    # ratio(): a weight of 0 (telemetry out of range, computed again without
    # it) must not end the pass with a division by zero.
    x = ratio(F.col("cost"), F.coalesce("key_weight", F.lit(1.0)))
    pair = _key_hash()

    def signed(j: int) -> Column:
        sign = F.shiftright(pair, 32 + j).bitwiseAND(1)
        return F.when(keyed, F.when(sign == 0, x).otherwise(-x)).otherwise(0.0)

    per_bucket = shuffled.groupBy(window.alias("window"), "queue", "key_bucket").agg(
        *_usage_sums(coded=True),
        F.sum(F.when(keyed, x).otherwise(0.0)).alias("key_x"),
        *(F.sum(signed(j)).alias(f"key_x{j}") for j in range(SIGNS)),
    )
    sketch = ["key_x", *(f"key_x{j}" for j in range(SIGNS))]
    label = F.when(
        F.col("key_bucket").isNotNull(), F.concat(F.lit(BUCKET), F.col("key_bucket").cast("string"))
    ).otherwise(F.lit(NO_KEY))
    none = F.lit(None).cast("double")
    return per_key.select(
        F.lit(GRAIN_KEY).alias("grain"), none.alias("window"), "queue", "fair_key", "key_bucket",
        *USAGE_FIGURES, *(none.alias(c) for c in sketch), "present",
    ).unionByName(per_bucket.select(
        F.lit(GRAIN_BUCKET).alias("grain"), "window", "queue", label.alias("fair_key"),
        "key_bucket", *USAGE_FIGURES, *sketch, F.lit(None).cast("long").alias("present"),
    ))  # fmt: skip


def key_rows(both: DataFrame) -> DataFrame:
    """The per-key rows of :func:`keys_and_buckets`, as :func:`shares_by_key` reads them."""
    return both.where(F.col("grain") == GRAIN_KEY).select(
        "queue", "fair_key", "records", "served_tasks", "served_cost", "codel_requeues",
        F.col("key_throttled").alias("throttled"), F.col("key_weight").alias("weight"), "present",
        F.col("key_paused").alias("paused"),
    )  # fmt: skip


def bucket_rows(both: DataFrame) -> DataFrame:
    """The bucket rows of :func:`keys_and_buckets`: ``usage_by_window`` rows and their sketch."""
    return both.where(F.col("grain") == GRAIN_BUCKET).drop("grain", "present")


def key_counts(tasks: DataFrame) -> DataFrame:
    """Per window and queue: the number of distinct fairness keys, estimated.

    HyperLogLog++ (``approx_count_distinct``, relative error about 1%), in a
    pass of its own over the tasks: with bucketed keys (:func:`keys_and_buckets`)
    and more windows than :func:`key_totals` counts from the keys' rows.
    The exact count would regroup every record by key, the pass the buckets
    avoid.
    """
    return (
        tasks.where(F.col("fair_key") != NO_KEY)
        .groupBy("window", "queue")
        .agg(F.approx_count_distinct("fair_key", 0.01).alias("n"))
        .select("window", "queue", "n")
    )


def jain_over_buckets(usage: DataFrame, counts: DataFrame) -> DataFrame:
    """Jain's index over keys per window and queue, from bucketed usage rows.

    The rows of ``jain_by_window`` over keys, estimated: n from ``counts``
    (:func:`keys_by_window` or :func:`key_counts`), the sum of x exact, the
    sum of x^2 from the buckets' signed sums (relative standard error at most
    sqrt(2 / (buckets x :data:`SIGNS`)), less when few keys share a bucket).
    """
    squares = F.lit(0.0)
    for j in range(SIGNS):
        squares = squares + F.sum(F.col(f"key_x{j}") * F.col(f"key_x{j}"))
    per_window = (
        usage.where(F.col("fair_key") != NO_KEY)
        .groupBy("window", "queue")
        .agg(
            F.sum("key_x").alias("sum_x"),
            (squares / SIGNS).alias("sum_x2"),
        )
        .join(counts, ["window", "queue"])
    )
    jain = F.col("sum_x") * F.col("sum_x") / (F.col("n") * F.col("sum_x2"))
    return per_window.select(
        "window",
        "queue",
        "n",
        # The estimate can pass 1 by a little: J is at most 1.
        F.when(F.col("sum_x2") > 0, F.least(jain, F.lit(1.0))).alias("jain"),
    )
