"""The two ways the report counts keys: exactly, or in buckets past many keys.

:func:`celery_fair.analytics.pipeline.compute` chooses one strategy from the
number of distinct keys (estimated in its first pass) and asks it for the
tables whose computation differs; every other table is computed the same way
from the usage table either strategy returns.

* :class:`ExactKeys`: a usage row per window, queue and key.
* :class:`BucketedKeys`: past ``exact_keys`` keys a row per window and key
  would be about a row per record, so one shuffle of the tasks gives a row per
  key over the report and a usage row per window, queue and bucket of keys
  (every per-queue figure stays exact; see
  :func:`~celery_fair.analytics.transforms.keys_and_buckets`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from celery_fair.analytics import transforms as T
from celery_fair.analytics.noisy import NoisyRules

__all__ = ("BucketedKeys", "ExactKeys", "KeyGrain")

#: The columns naming one usage row, and one bucketed usage row.
CELL = ("window", "queue", "fair_key")
BUCKET_CELL = ("window", "queue", "key_bucket")

Rows = Callable[..., list[dict[str, Any]]]


class KeyGrain(Protocol):
    """What differs between counting keys exactly and in buckets."""

    def usage(self, tasks: DataFrame) -> DataFrame:
        """The usage table, cached (the tables below read it a dozen times).

        Possibly not computed yet: the pipeline's first job over it (the
        count of records out of range) fills the cache.
        """

    def keys(self, usage: DataFrame) -> DataFrame:
        """A row per queue and key over the report, with its share."""

    def jain_keys(self, usage: DataFrame) -> DataFrame:
        """Jain's index over the keys of each window and queue."""

    def noisy_windows(self, usage: DataFrame, tasks: DataFrame, rows: Rows) -> list[dict[str, Any]]:
        """The noisy-window findings, as rows."""

    def release(self) -> None:
        """Unpersist what this strategy cached."""


class ExactKeys:
    """A usage row per window, queue and key."""

    def __init__(self, window: float, rules: NoisyRules, parallelism: int) -> None:
        self.window, self.rules, self.parallelism = window, rules, parallelism
        self._keys: DataFrame | None = None

    def usage(self, tasks: DataFrame) -> DataFrame:
        return tasks.transform(T.usage_by_window).coalesce(self.parallelism).cache()

    def keys(self, usage: DataFrame) -> DataFrame:
        self._keys = usage.transform(T.key_shares).cache()
        return self._keys

    def jain_keys(self, usage: DataFrame) -> DataFrame:
        return usage.transform(T.served_by_window, "fair_key").transform(T.jain_by_window)

    def noisy_windows(self, usage: DataFrame, tasks: DataFrame, rows: Rows) -> list[dict[str, Any]]:
        return rows(usage.transform(T.noisy_windows, self.window, self.rules), CELL)

    def release(self) -> None:
        if self._keys is not None:
            self._keys.unpersist()


class BucketedKeys:
    """Past many keys: a row per key over the report, usage per bucket of keys."""

    def __init__(
        self,
        spark: SparkSession,
        *,
        window: float,
        rules: NoisyRules,
        parallelism: int,
        buckets: int,
        spread: T.Windows,
        exact_windows: int,
        parts: int,
        conf: Callable[[], Any],
    ) -> None:
        self.spark, self.window, self.rules = spark, window, rules
        self.parallelism, self.buckets, self.spread, self.parts = (
            parallelism,
            buckets,
            spread,
            parts,
        )
        #: The keys of each window are counted from the key rows while the
        #: windows fit one ``present`` mask; past them a pass estimates them.
        self.masked = spread.count <= min(exact_windows, T.MASK_BITS)
        self._conf = conf  # the many-keys pass's session settings (a context manager)
        self._cached: list[DataFrame] = []
        self._per_key: DataFrame | None = None
        self._totals: DataFrame | None = None
        self._counts: DataFrame | None = None

    def _keep(self, df: DataFrame) -> DataFrame:
        df = df.cache()
        df.count()
        self._cached.append(df)
        return df

    def usage(self, tasks: DataFrame) -> DataFrame:
        spread, masked = self.spread, self.masked
        # One shuffle of the tasks for both grains, cached: every table
        # below reads its key rows or its bucket rows.
        with self._conf():
            grains = tasks.transform(T.keys_and_buckets, self.buckets, spread, self.parts, masked)
            grains = self._keep(grains.coalesce(self.parallelism))
        self._per_key = grains.transform(T.key_rows)
        # The per-queue totals and the keys of each window in one pass over
        # the keys, cached (a few rows). The key table is not cached apart:
        # its rows are the cached key rows joined with these totals, and a
        # copy of a million rows cost more than the joins.
        self._totals = self._keep(self._per_key.transform(T.key_totals, spread if masked else None))
        if masked:
            counts = self._totals.transform(T.keys_by_window, spread)
        else:
            counts = tasks.transform(T.key_counts)
        self._counts = self._keep(counts)
        return grains.transform(T.bucket_rows)

    def keys(self, usage: DataFrame) -> DataFrame:
        assert self._per_key is not None, "usage() first"
        return self._per_key.transform(T.shares_by_key, self._totals)

    def jain_keys(self, usage: DataFrame) -> DataFrame:
        return usage.transform(T.jain_over_buckets, self._counts)

    def noisy_windows(self, usage: DataFrame, tasks: DataFrame, rows: Rows) -> list[dict[str, Any]]:
        """The rules over the buckets, then inside the flagged buckets by their own keys."""
        totals = usage.transform(T.window_totals, self._counts).cache()
        try:
            window, rules = self.window, self.rules
            flagged = usage.transform(T.noisy_windows, window, rules, totals).join(
                usage.select(*CELL, "key_bucket"), list(CELL)
            )
            cells = rows(flagged.select(*BUCKET_CELL))
            if not cells:
                return []  # no pass over the tasks
            # The tasks of the flagged buckets only, grouped by their own keys.
            chosen = self.spark.createDataFrame(cells, usage.select(*BUCKET_CELL).schema)
            inside = (
                tasks.select("*", T.key_bucket(self.buckets).alias("key_bucket"))
                .join(F.broadcast(chosen), list(BUCKET_CELL))
                .drop("key_bucket")
                .transform(T.usage_by_window)
            )
            return rows(inside.transform(T.noisy_windows, window, rules, totals), CELL)
        finally:
            totals.unpersist()

    def release(self) -> None:
        for df in self._cached:
            df.unpersist()
