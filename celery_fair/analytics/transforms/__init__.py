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

One module per concept: :mod:`.tasks` (normalised rows and usage),
:mod:`.buckets` (very many keys), :mod:`.shares` (shares, fairness,
throughput), :mod:`.findings` (advice and suspects), :mod:`.levels`
(priorities), :mod:`.resources` (what tenants held of the workers' capacity)
and :mod:`.validation` (values out of range); every name is imported from
here.
"""

from __future__ import annotations

from .buckets import (
    BUCKET,
    GRAIN_BUCKET,
    GRAIN_KEY,
    MASK_BITS,
    SIGNS,
    bucket_rows,
    jain_over_buckets,
    key_bucket,
    key_counts,
    key_rows,
    keys_and_buckets,
)
from .findings import (
    MAX_ROUND_TRIP,
    across_queues,
    hot_keys,
    noisy_keys,
    noisy_windows,
    paused_keys,
    recommendations,
    routing_skew,
    throttled_keys,
    window_totals,
)
from .levels import key_shares_by_priority, waits_by_priority
from .resources import (
    capacity_by_window,
    held_by_window,
    held_rows,
    resource_shares,
    resource_usage,
    tenant_held,
)
from .shares import (
    codel_rates,
    jain_by_window,
    key_shares,
    key_totals,
    keys_by_window,
    queue_shares,
    served_by_window,
    shares_by_key,
    throughput,
    top_keys,
)
from .tasks import (
    NO_KEY,
    RAN,
    USAGE_FIGURES,
    Windows,
    normalize,
    ratio,
    usage_by_window,
    window_start,
)
from .validation import (
    RULES,
    any_bad,
    bad_value_counts,
    exclude_bad_values,
    rule_counts,
)

__all__ = (
    "RULES",
    "any_bad",
    "bad_value_counts",
    "exclude_bad_values",
    "rule_counts",
    "BUCKET",
    "GRAIN_BUCKET",
    "GRAIN_KEY",
    "MASK_BITS",
    "MAX_ROUND_TRIP",
    "NO_KEY",
    "SIGNS",
    "USAGE_FIGURES",
    "RAN",
    "Windows",
    "bucket_rows",
    "capacity_by_window",
    "held_by_window",
    "held_rows",
    "resource_shares",
    "resource_usage",
    "tenant_held",
    "codel_rates",
    "across_queues",
    "throttled_keys",
    "paused_keys",
    "hot_keys",
    "jain_by_window",
    "jain_over_buckets",
    "key_bucket",
    "key_counts",
    "key_rows",
    "key_shares",
    "key_shares_by_priority",
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
    "waits_by_priority",
    "usage_by_window",
    "window_start",
    "window_totals",
)
