"""The report's transforms: pure ``DataFrame -> DataFrame`` functions.

Each transform opens or closes with a ``select`` naming its columns and uses
Spark's built-in functions only (no Python UDFs), so the same code runs on a
laptop and on a cluster. They compose with ``DataFrame.transform``::

    tasks = raw.transform(normalize, 60.0)
    usage = tasks.transform(usage_by_window).cache()
    shares = usage.transform(queue_shares)
    jain = usage.transform(served_by_window, "queue").transform(jain_by_window)

``normalize`` is the only transform that reads the telemetry schema. Two
read its task rows, and they are the only ones that touch every record:
``usage_by_window`` (every additive figure, at the finest grain the report
needs: window x queue x key) and ``quantiles.latency_histograms``. The
others read those two small tables, so adding a figure costs no pass over
the data. With very many keys, where a row per window and key is about a
row per record, :func:`keys_and_buckets` takes its place: one shuffle of
the task rows, then a row per key over the report and a row per window,
queue and bucket of keys (see ``pipeline.compute``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from celery_fair.analytics.noisy import DEFAULT_RULES, NoisyRules
from celery_fair.telemetry.schema import OUTCOMES

__all__ = (
    "RAN",
    "Windows",
    "bucket_rows",
    "codel_rates",
    "held_keys",
    "hot_keys",
    "jain_by_window",
    "jain_over_buckets",
    "key_bucket",
    "key_counts",
    "key_rows",
    "key_shares",
    "key_totals",
    "keys_and_buckets",
    "keys_by_window",
    "noisy_keys",
    "noisy_windows",
    "normalize",
    "queue_shares",
    "ratio",
    "recommendations",
    "routing_skew",
    "served_by_window",
    "shares_by_key",
    "throughput",
    "top_keys",
    "usage_by_window",
    "window_start",
    "window_totals",
)

#: Outcomes of tasks that ran on the pool (and were charged).
RAN: tuple[str, ...] = ("success", "failure", "retry")
NO_KEY = "(none)"
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


def ratio(numerator: Column, denominator: Column) -> Column:
    """numerator / denominator, null when the denominator is 0 (ANSI mode raises)."""
    return F.when(denominator != 0, numerator / denominator)


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
    (null in records of schema 1), ``key_held`` the seconds its key spent set
    aside by its per-key limits (0 when unknown). ``in_flight`` is receive -> finish,
    the time the worker held the task (0 when unknown); ``busy`` its run time
    on the pool (0 for tasks that never ran). ``window`` is the start of the
    ``window_seconds`` bucket holding the time the task left the worker.

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
        F.coalesce("key_held", F.lit(0.0)).alias("key_held"),
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
    )


def window_start(left_at: Column, window_seconds: float) -> Column:
    """The start of the window of ``window_seconds`` holding ``left_at`` (``normalize``)."""
    return F.floor(left_at / window_seconds) * window_seconds


#: The additive figures of a usage row, after the columns naming it.
USAGE_FIGURES = (
    "records", "served_tasks", "served_cost", "in_flight", "busy", "codel_requeues",
    "codel_rejects", "failures", "retries", "revoked", "last_at", "weight", "key_held",
    "key_weight",
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
        F.sum("key_held").alias("key_held"),
        F.max_by("key_weight", "left_at").alias("key_weight"),
    ]


def usage_by_window(tasks: DataFrame) -> DataFrame:
    """Per window, queue and fairness key: every additive figure of the report.

    The one aggregation over all the task rows: shares, Jain's index,
    throughput, CoDel rates, routing skew and the noisy-tenant rules are all
    sums of these columns, computed from this small table (windows x keys
    rows) instead of each scanning the data again. ``weight`` is the group's
    latest target weight, with ``last_at`` the time it was seen, and
    ``key_weight`` the key's; ``key_held`` the seconds the key spent set
    aside by its per-key limits.
    """
    return (
        tasks.groupBy("window", "queue", "fair_key")
        .agg(*_usage_sums())
        .select("window", "queue", "fair_key", *USAGE_FIGURES)
    )


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
    "left_at", "weight", "key_held", "key_weight",
)  # fmt: skip


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
    x = F.col("cost") / F.coalesce("key_weight", F.lit(1.0))
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
        F.col("key_held").alias("held"), F.col("key_weight").alias("weight"), "present",
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


def queue_shares(usage: DataFrame) -> DataFrame:
    """Per queue: share of served cost beside the target share from the weights.

    Reads ``usage_by_window`` rows. The target weight is the latest one a
    queue's records carry (weights can change at run time); ``target_share``
    is it over the sum of the queues'.
    """
    everything = Window.partitionBy()
    per_queue = usage.groupBy("queue").agg(
        F.sum("records").alias("records"),
        F.sum("served_tasks").alias("served_tasks"),
        F.sum("served_cost").alias("served_cost"),
        F.max_by("weight", "last_at").alias("target_weight"),
    )
    return per_queue.select(
        "queue",
        "records",
        "served_tasks",
        "served_cost",
        ratio(F.col("served_cost"), F.sum("served_cost").over(everything)).alias("share"),
        "target_weight",
        ratio(F.col("target_weight"), F.sum("target_weight").over(everything)).alias(
            "target_share"
        ),
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
        F.sum("key_held").alias("held"),
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
    everything = Window.partitionBy()
    return per_queue.select(
        "*",
        F.sum("queue_cost").over(everything).alias("all_cost"),
        F.sum("keys_in_queue").over(everything).alias("keys_overall"),
    )


def shares_by_key(per_key: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """The ``key_shares`` table from one row per queue and key (:func:`key_rows`).

    ``keys_in_queue`` counts the fairness keys of the queue (tasks without a
    key are not a key), ``keys_overall`` those of every queue. ``weight`` is
    the key's latest weight (1 when the records do not carry it);
    ``target_in_queue`` is it over the sum of the weights of the queue's
    keys: the share weighted fairness gives the key while every key of the
    queue has work waiting (a key that is often idle gets less and leaves its
    part to the others). ``held`` is the seconds the key spent set aside by
    its per-key limits; ``codel_requeues`` feeds :func:`routing_skew`.

    ``totals`` are :func:`key_totals` of ``per_key``, when already made.
    """
    rows = per_key.select(
        "queue", "fair_key", "records", "served_tasks", "served_cost", "codel_requeues", "held",
        _key_weight().alias("weight"),
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
        "held",
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
    everything = Window.partitionBy()
    arrived = keys.select(
        "queue", "fair_key", (F.col("records") - F.col("codel_requeues")).alias("arrivals")
    ).where(F.col("arrivals") > 0)
    per_queue = arrived.groupBy("queue").agg(
        F.sum("arrivals").alias("arrivals"),
        F.count(F.lit(1)).alias("keys"),  # a row per key: no distinct
    )
    arrival_share = ratio(F.col("arrivals"), F.sum("arrivals").over(everything))
    return per_queue.join(shares.select("queue", "target_share"), "queue", "left").select(
        "queue",
        "arrivals",
        arrival_share.alias("arrival_share"),
        "keys",
        ratio(F.col("keys"), F.sum("keys").over(everything)).alias("key_share"),
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


def held_keys(keys: DataFrame, top: int = 20) -> DataFrame:
    """The ``top`` keys that spent longest set aside by their limits, from ``key_shares``.

    Collected apart from the most served keys: a throttled key is served
    little, by design, and could be missing from those.
    """
    return (
        keys.where(F.col("held") > 0)
        .orderBy(F.col("held").desc(), "queue", "fair_key")
        .limit(top)
        .select("queue", "fair_key", "held", "served_tasks", "weight")
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
