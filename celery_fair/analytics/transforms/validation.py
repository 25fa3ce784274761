"""Telemetry validation: values out of range are counted per file and column, then left out.

Telemetry may come from older releases, from other writers of the schema, or
from a bug: a weight of 0 would divide by zero in Jain's index, a negative
run time would lower a key's served work.  The report must not end on such a
value, nor let it corrupt a figure.  :data:`RULES` names each check.
:func:`any_bad` marks a record with any bad value; ``normalize`` carries the
mark and the usage table counts it (``bad_records``), so clean telemetry is
screened in the pass that reads those columns anyway (screening them in the
first pass, which otherwise reads five columns, added 1.8 s at 10M records,
where a bare scan of every column took 4-5 s).  Only when there are some,
:func:`bad_value_counts` counts them per file and rule, and
:func:`exclude_bad_values` sets each bad value to null (the figures that read
it treat it as unknown) and drops records whose outcome is unknown (every
figure reads the outcome).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from celery_fair.telemetry.schema import OUTCOMES

__all__ = ("RULES", "Rule", "any_bad", "bad_value_counts", "exclude_bad_values", "rule_counts")


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
    Rule("key_throttled", NOT_NEGATIVE),
    Rule("key_paused", NOT_NEGATIVE),
    Rule("outcome", KNOWN_OUTCOME),
)


def any_bad() -> Column:
    """Whether a telemetry record has a value out of range (any rule's)."""
    bad = F.lit(False)
    for rule in RULES:
        bad = bad | rule.bad()
    return bad


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
