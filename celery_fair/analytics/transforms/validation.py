"""Telemetry validation: values out of range are counted per file and column, then left out.

Telemetry may come from older releases, from other writers of the schema, or
from a bug: a weight of 0 would divide by zero in Jain's index, a negative
run time would lower a key's served work.  The report must not end on such a
value, nor let it corrupt a figure.  :data:`RULES` names each check;
:func:`screens` tells whether there are any (plain aggregates the pipeline
folds into its first pass) and, when there are, :func:`bad_value_counts`
counts them per file (a pass of its own: grouping by file costs the first
pass several times over on clean telemetry); :func:`exclude_bad_values` sets
each bad value to null (the figures that read it treat it as unknown) and
drops records whose outcome is unknown (every figure reads the outcome).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from celery_fair.telemetry.schema import OUTCOMES

__all__ = (
    "RULES", "Rule", "bad_value_counts", "exclude_bad_values", "found", "rule_counts", "screens",
)  # fmt: skip


#: What a rule asks of its column.
POSITIVE, NOT_NEGATIVE, KNOWN_OUTCOME = "positive", "not negative", "known outcome"


@dataclass(frozen=True)
class Rule:
    """One check of one column: ``kind`` is :data:`POSITIVE`, :data:`NOT_NEGATIVE`
    (NaN fails both) or :data:`KNOWN_OUTCOME` (one of ``OUTCOMES``)."""

    column: str
    kind: str

    @property
    def name(self) -> str:
        """The count's column name: ``bad_<column>``."""
        return f"bad_{self.column}"

    @property
    def why(self) -> str:
        """What a bad value is, for people."""
        if self.kind == KNOWN_OUTCOME:
            return "not one of " + ", ".join(OUTCOMES)
        return "<= 0 or NaN" if self.kind == POSITIVE else "< 0 or NaN"

    def bad(self) -> Column:
        c = F.col(self.column)
        if self.kind == KNOWN_OUTCOME:
            return c.isNull() | ~c.isin(*OUTCOMES)
        low = c <= 0 if self.kind == POSITIVE else c < 0
        return c.isNotNull() & (F.isnan(c) | low)


#: The checks, one per column: weights must be above 0, durations and costs
#: not below 0, outcomes one of ``OUTCOMES``.
RULES: tuple[Rule, ...] = (
    Rule("key_weight", POSITIVE),
    Rule("target_weight", POSITIVE),
    Rule("runtime", NOT_NEGATIVE),
    Rule("cost", NOT_NEGATIVE),
    Rule("key_held", NOT_NEGATIVE),
    Rule("key_paused", NOT_NEGATIVE),
    Rule("outcome", KNOWN_OUTCOME),
)


def screens() -> list[Column]:
    """Cheap aggregations that tell whether any value is out of range (see :func:`found`).

    A numeric column's min and max (Spark orders NaN above every number, so
    the max is NaN when any value is), the count of unknown outcomes: plain
    aggregates, where :func:`rule_counts` evaluates a condition per value.
    """
    out = []
    for rule in RULES:
        if rule.kind == KNOWN_OUTCOME:
            out.append(F.sum(rule.bad().cast("long")).alias(rule.name))
        else:
            out += [F.min(rule.column).alias(f"min_{rule.column}"),
                    F.max(rule.column).alias(f"max_{rule.column}")]  # fmt: skip
    return out


def found(row: Any) -> bool:
    """Whether the :func:`screens` of ``row`` show a value out of range."""
    for rule in RULES:
        if rule.kind == KNOWN_OUTCOME:
            if row[rule.name]:
                return True
            continue
        low, high = row[f"min_{rule.column}"], row[f"max_{rule.column}"]
        if low is None:
            continue
        if math.isnan(high) or low < 0 or (rule.kind == POSITIVE and low == 0):
            return True
    return False


def rule_counts() -> list[Column]:
    """Aggregations counting each rule's bad values (``bad_<column>``)."""
    return [F.sum(rule.bad().cast("long")).alias(rule.name) for rule in RULES]


def bad_value_counts(raw: DataFrame) -> DataFrame:
    """Per telemetry file, the count of each rule's bad values (files with none too)."""
    return raw.withColumn("file", F.input_file_name()).groupBy("file").agg(*rule_counts())


def exclude_bad_values(raw: DataFrame) -> DataFrame:
    """``raw`` with each out-of-range value set to null and records of unknown outcome dropped."""
    nulled = {r.column: r for r in RULES if r.kind != KNOWN_OUTCOME}
    columns = [
        F.when(nulled[c].bad(), F.lit(None)).otherwise(F.col(c)).alias(c) if c in nulled else c
        for c in raw.columns
    ]
    known = [~r.bad() for r in RULES if r.kind == KNOWN_OUTCOME]
    for condition in known:
        raw = raw.where(condition)
    return raw.select(*columns)
