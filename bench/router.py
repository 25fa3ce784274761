"""Benchmark of consistent-hash routing: cost per decision, quality of the mapping, alternatives.

Run with ``python -m bench.router``. Writes ``bench/results/router.json`` and
``bench/results/router.md``. Two measurements in one run, a third and a fourth on request:

1. Routing decisions per second at 4, 16, 256 and 10,000 queues with keys that
   never repeat (every repetition draws fresh keys; the router runs with
   ``cache_size=0``), for the ring and the router under each algorithm, the
   variants alternated within each repetition. The acceptance figure is the
   ratio of the table's (and ``auto``'s) cost per decision at 10,000 queues to
   its cost at 4, taken within each repetition (median and range). Also the
   table's build time, memory and the cost of a weight change.
2. Quality of the mapping, rendezvous (the old default) against the probe
   table, on the same keys: chi-square goodness of fit, the worst share
   error, and the fraction of keys moved by removing the first, middle and
   last queue and by adding one, against the least any mapping must move.
   For the table the exact shares and moved fractions are also computed from
   the table itself (``HashRing.mapped_shares``), free of sampling noise.
   Also what a switch from rendezvous to the table moves (the migration).
3. ``--alternatives`` adds the two mappings rejected for the table (docs/routing.md,
   "Why not Maglev or jump hashing" cites their figures): a weighted Maglev table
   (Eisenbud et al., NSDI 2016) with 100 x n and 1,000 x n entries, its moved
   fractions computed exactly from the table; a weighted jump consistent hash
   (Lamping & Veach, 2014) over virtual buckets, its moved fractions and cost
   sampled. ``bench/results/router.md`` was made with them.
4. ``--apply-async`` runs this alone, into ``bench/results/router.apply_async.*``
   (it starts a Redis): ``apply_async`` to a real Redis with plain Celery
   routing against the same call through ``ConsistentHashRouter``, variants
   alternated within each repetition; the median and the spread of the
   per-repetition ratios.

The default run (1 and 2) takes under three minutes on two cores;
``--alternatives`` adds about 12 s.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from celery import Celery
from scipy import stats

from celery_fair.routing import ConsistentHashRouter, HashRing
from celery_fair.routing.ring import ideal_moved_fraction, key_hash
from celery_fair.routing.table import probe_table
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE_COUNTS = (4, 16, 256, 10_000)
ALGORITHMS = ("auto", "rendezvous", "table")


def weights(n: int) -> dict[str, int]:
    return {f"q{i:05d}": 1 + i % 4 for i in range(n)}


def quality_weights(n: int) -> dict[str, int]:
    # Four queues as in the unit tests and the docs (1, 1, 2, 2); larger rings as above.
    return {"q1": 1, "q2": 1, "q3": 2, "q4": 2} if n == 4 else weights(n)


# -- 1. decisions per second ---------------------------------------------------------------


def _keys_for(n_keys: int, queues: int, algorithm: str) -> int:
    # Rendezvous is O(n): fewer keys keep a repetition short at 256 and 10,000 queues.
    if algorithm == "rendezvous" or (algorithm == "auto" and queues <= 12):
        return max(100, min(n_keys, n_keys * 16 // queues))
    return n_keys


def decisions_per_second(n_keys: int, repeats: int) -> dict[str, Any]:
    """Decisions per second; variants alternated within each repetition, fresh keys each time."""
    rings: dict[tuple[int, str], HashRing] = {}
    for n in QUEUE_COUNTS:
        for algorithm in ALGORITHMS:
            rings[n, algorithm] = HashRing(weights(n), algorithm=algorithm)
    routers = {
        (n, algorithm): ConsistentHashRouter(ring, key="tenant_id", cache_size=0)
        for (n, algorithm), ring in rings.items()
    }
    memo_routers = {
        n: ConsistentHashRouter(rings[n, "auto"], key="tenant_id") for n in QUEUE_COUNTS
    }
    variants: list[tuple[str, int, str]] = []
    for n in QUEUE_COUNTS:
        for algorithm in ALGORITHMS:
            variants.append(("ring", n, algorithm))
            variants.append(("router", n, algorithm))
        variants.append(("router_memo", n, "auto"))
    rates: dict[tuple[str, int, str], list[float]] = {v: [] for v in variants}
    recurring = [f"tenant-{i % 1000:04d}" for i in range(n_keys)]
    for rep in range(repeats):
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for kind, n, algorithm in order:
            count = _keys_for(n_keys, n, algorithm)
            # Keys that never repeat: a new prefix per repetition and variant.
            fresh = [f"tenant-{rep}-{kind}-{n}-{algorithm}-{i:08d}" for i in range(count)]
            if kind == "ring":
                lookup = rings[n, algorithm].lookup
                start = time.perf_counter()
                for k in fresh:
                    lookup(k)
            elif kind == "router":
                route = routers[n, algorithm]
                start = time.perf_counter()
                for k in fresh:
                    route("bench.task", (), {"tenant_id": k}, {})
            else:
                route = memo_routers[n]
                fresh = recurring
                start = time.perf_counter()
                for k in fresh:
                    route("bench.task", (), {"tenant_id": k}, {})
            rates[kind, n, algorithm].append(len(fresh) / (time.perf_counter() - start))
    rows = []
    for n in QUEUE_COUNTS:
        row: dict[str, Any] = {
            "queues": n,
            "auto_resolves_to": rings[n, "auto"].algorithm,
            "router_1000_tenants_memo": summary(rates["router_memo", n, "auto"]),
        }
        for algorithm in ALGORITHMS:
            row[f"ring_{algorithm}"] = summary(rates["ring", n, algorithm])
            row[f"router_{algorithm}_no_memo"] = summary(rates["router", n, algorithm])
        rows.append(row)
    ratios = {}
    for kind in ("ring", "router"):
        for algorithm in ("auto", "table"):
            small, large = rates[kind, 4, algorithm], rates[kind, 10_000, algorithm]
            # cost ratio = rate at 4 / rate at 10,000, paired within each repetition
            ratios[f"{kind}_{algorithm}"] = summary(
                [a / b for a, b in zip(small, large, strict=True)]
            )
    return {
        "keys_per_run": n_keys,
        "repetitions": repeats,
        "rows": rows,
        "cost_ratio_10000_vs_4": ratios,
    }


_MEMORY_PROBE = """
import json, sys
from celery_fair.routing.ring import HashRing
def status(field):
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024
n = int(sys.argv[1])
w = {f"q{i:05d}": 1 + i % 4 for i in range(n)}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
base = status("VmRSS")
ring = HashRing(w, algorithm="table")
print(json.dumps({"retained": status("VmRSS") - base, "peak": status("VmHWM") - base}))
"""


def _table_memory(n: int) -> dict[str, float]:
    """Resident memory a table adds and its peak while building, in a fresh interpreter (Linux)."""
    # A child process, so that the memo and earlier work are not counted; tracemalloc
    # would slow the build several times over.
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(n)], check=True, capture_output=True, text=True
    ).stdout
    measured = json.loads(out)
    return {"retained_mb": measured["retained"] / 1e6, "peak_mb": measured["peak"] / 1e6}


def table_costs(repeats: int) -> list[dict[str, Any]]:
    """Build time (fresh and memoised), memory and the cost of a weight change per size."""
    rows = []
    for n in QUEUE_COUNTS:
        w = weights(n)
        builds, memo_hits = [], []
        for _ in range(repeats):
            probe_table.cache_clear()  # a fresh build, not the memo's copy
            start = time.perf_counter()
            ring = HashRing(w, algorithm="table")
            builds.append(time.perf_counter() - start)
            # The same queue set listed in another order: the memo's table is reused.
            start = time.perf_counter()
            HashRing(dict(reversed(list(w.items()))), algorithm="table")
            memo_hits.append(time.perf_counter() - start)
        start = time.perf_counter()
        ring.with_weight(ring.queues[0], 3)
        reweight = time.perf_counter() - start
        layout = ring.layout
        assert layout is not None
        record = ring.statistics()
        memory = _table_memory(n)
        rows.append(
            {
                "queues": n,
                "total_weight": sum(w.values()),
                "band": layout.band,
                "band_top": layout.band_top,
                "slots_per_weight": layout.slots_per_weight,
                "slots": record.table_slots,
                "buckets": record.table_buckets,
                "build_seconds": summary(builds),
                "memoised_build_seconds": summary(memo_hits),
                "memory_retained_mb": memory["retained_mb"],
                "memory_peak_mb": memory["peak_mb"],
                "with_weight_seconds": reweight,
            }
        )
    return rows


# -- 2. quality: shares and moved fractions -------------------------------------------------


def _quality_keys(n: int, algorithm: str) -> int:
    """Keys sampled per ring: enough for the chi-square test, as few as rendezvous allows."""
    if n == 10_000:
        # The table: 12 expected keys for a weight-1 queue. Rendezvous: 6 ms a key, and
        # exact by construction, so only its exact figures are given.
        return 300_000 if algorithm == "table" else 0
    return {4: 100_000, 16: 100_000, 256: 10_000}[n]


def _sample_changes(n: int) -> bool:
    # At 10,000 queues one removal moves 0.004% of keys: sampling says nothing there.
    return n < 10_000


def _changes(ring: HashRing) -> list[tuple[str, str, HashRing]]:
    names = ring.queues
    return [
        ("remove first", names[0], ring.without_queue(names[0])),
        ("remove middle", names[len(names) // 2], ring.without_queue(names[len(names) // 2])),
        ("remove last", names[-1], ring.without_queue(names[-1])),
        ("add one (weight 2)", "new", ring.with_queue("new", 2)),
    ]


def quality(seed: int) -> list[dict[str, Any]]:
    results = []
    for n in QUEUE_COUNTS:
        w = quality_weights(n)
        rng = random.Random(seed + n)
        hashes_all = [rng.getrandbits(64) for _ in range(_quality_keys(n, "table"))]
        before_by_algorithm: dict[str, list[str]] = {}
        for algorithm in ("rendezvous", "table"):
            count = _quality_keys(n, algorithm)
            hashes = hashes_all[:count]
            ring = HashRing(w, algorithm=algorithm)
            entry: dict[str, Any] = {"queues": n, "algorithm": algorithm, "keys": count}
            shares = ring.shares()
            before: list[str] = []
            if count:
                before = [ring.lookup_hash(h) for h in hashes]
                before_by_algorithm[algorithm] = before
                counts = Counter(before)
                names = sorted(shares)
                observed = [counts[q] for q in names]
                expected = [count * shares[q] for q in names]
                test = stats.chisquare(observed, expected)
                entry["chi2_statistic"] = float(test.statistic)
                entry["chi2_dof"] = len(names) - 1
                entry["chi2_pvalue"] = float(test.pvalue)
                smallest = min(shares.values())
                if count * smallest >= 100:
                    # Below ~100 expected keys the normal band misleads; chi-square suffices.
                    entry["worst_share_error_sampled"] = max(
                        abs(counts[q] / count - shares[q]) / shares[q] for q in names
                    )
                    # 4.5 sigma of the binomial sampling error of the smallest queue
                    entry["sampling_band"] = 4.5 * math.sqrt((1 - smallest) / (count * smallest))
            # For rendezvous the mapped shares are the weight shares, exact by construction.
            exact = ring.mapped_shares()
            entry["worst_share_error_exact"] = max(
                abs(exact[q] - shares[q]) / shares[q] for q in shares
            )
            # Removing queue q moves exactly q's keys: over every queue of the ring, the
            # ratio of that fraction to the ideal is mapped share / weight share.
            removal = sorted(exact[q] / shares[q] for q in shares)
            entry["removal_ratio_all_queues"] = {
                "min": removal[0],
                "p01": removal[len(removal) // 100],
                "median": statistics.median(removal),
                "p99": removal[-1 - len(removal) // 100],
                "max": removal[-1],
                "share_above_1_05": sum(r > 1.05 for r in removal) / len(removal),
            }
            changes = []
            for label, name, changed in _changes(ring):
                ideal = ideal_moved_fraction(ring, changed)
                row: dict[str, Any] = {"change": label, "queue": name, "ideal": ideal}
                row["same_layout"] = changed.layout == ring.layout
                if count and _sample_changes(n):
                    after = [changed.lookup_hash(h) for h in hashes]
                    pairs = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
                    row["moved_sampled"] = len(pairs) / count
                    row["ratio_sampled"] = row["moved_sampled"] / ideal
                    row["only_changed_queue"] = all(name in (a, b) for a, b in pairs)
                # Per-key minimality: the moved keys are exactly the removed queue's, or
                # exactly those the new queue wins; their fraction is its mapped share.
                mapped = changed.mapped_shares() if label.startswith("add") else exact
                row["moved_exact"] = mapped[name]
                row["ratio_exact"] = row["moved_exact"] / ideal
                changes.append(row)
            entry["changes"] = changes
            results.append(entry)
        if len(before_by_algorithm) == 2:
            # The migration: keys whose queue differs between the two mappings.
            old, new = before_by_algorithm["rendezvous"], before_by_algorithm["table"]
            shares = HashRing(w).shares()
            results[-1]["switch_from_rendezvous"] = {
                "keys": len(old),
                "moved_sampled": sum(a != b for a, b in zip(old, new, strict=True)) / len(old),
                "unrelated_mappings": 1.0 - math.fsum(s * s for s in shares.values()),
            }
    return results


# -- 3. alternatives: weighted Maglev --------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(n: int) -> int:
    while not _is_prime(n):
        n += 1
    return n


def maglev_table(w: dict[str, float], size: int) -> list[str]:
    """A weighted Maglev lookup table (Eisenbud et al., NSDI 2016), written for this benchmark.

    Each queue walks its own permutation of the entries (offset + j * skip,
    size prime); queues take turns in the order of (k + 1/2) / weight, so each
    takes entries in proportion to its weight, and a queue's k-th turn claims
    its next still-free entry, until its quota (largest remainder of
    size * share) is met.
    """
    names = sorted(w)
    total = math.fsum(w.values())
    exact = {q: size * w[q] / total for q in names}
    quota = {q: int(exact[q]) for q in names}
    for q in sorted(names, key=lambda q: (-(exact[q] - quota[q]), q))[: size - sum(quota.values())]:
        quota[q] += 1
    table: list[int] = [-1] * size
    walk = []
    for q in names:
        h = key_hash(f"maglev:{q}")
        walk.append([h % size, (h >> 32) % (size - 1) + 1, 0])
    heap = [(0.5 / w[q], i, 0) for i, q in enumerate(names) if quota[q]]
    heapq.heapify(heap)
    taken = [0] * len(names)
    for _ in range(size):
        _, i, k = heap[0]
        offset, skip, j = walk[i]
        entry = (offset + j * skip) % size
        while table[entry] >= 0:
            j += 1
            entry = (offset + j * skip) % size
        table[entry] = i
        walk[i][2] = j + 1
        taken[i] += 1
        if taken[i] == quota[names[i]]:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, ((k + 1.5) / w[names[i]], i, k + 1))
    return [names[i] for i in table]


def alternatives() -> list[dict[str, Any]]:
    rows = []
    for n in (16, 256):
        w: dict[str, float] = dict(quality_weights(n))
        names = sorted(w)
        for factor in (100, 1000):
            size = _next_prime(factor * n)
            start = time.perf_counter()
            base = maglev_table(w, size)
            build = time.perf_counter() - start
            shares = {q: c / size for q, c in Counter(base).items()}
            total = math.fsum(w.values())
            worst = max(abs(shares[q] - w[q] / total) / (w[q] / total) for q in names)
            changes = []
            for label, name in (
                ("remove first", names[0]),
                ("remove middle", names[n // 2]),
                ("remove last", names[-1]),
                ("add one (weight 2)", "new"),
            ):
                if label.startswith("add"):
                    other = {**w, name: 2.0}
                else:
                    other = {q: v for q, v in w.items() if q != name}
                table = maglev_table(other, size)
                moved = sum(a != b for a, b in zip(base, table, strict=True)) / size
                ideal = ideal_moved_fraction(HashRing(w), HashRing(other))
                changes.append({"change": label, "moved": moved, "ideal": ideal,
                                "ratio": moved / ideal})  # fmt: skip
            rows.append(
                {
                    "algorithm": "maglev (weighted)",
                    "queues": n,
                    "table_size": size,
                    "build_seconds": build,
                    "worst_share_error": worst,
                    "changes": changes,
                }
            )
    return rows


_MASK64 = (1 << 64) - 1


def jump_bucket(h: int, buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach, arXiv:1406.2294, 2014): ``h``'s bucket of ``buckets``.

    Written for this benchmark from the paper's description: the key's linear
    congruential stream decides, bucket count by bucket count, where it jumps next.
    """
    bucket, candidate = -1, 0
    while candidate < buckets:
        bucket = candidate
        h = (h * 2862933555777941757 + 1) & _MASK64
        candidate = int((bucket + 1) * ((1 << 31) / ((h >> 33) + 1)))
    return bucket


class WeightedJump:
    """Jump hashing over virtual buckets: ``per_weight * w`` consecutive buckets per queue.

    Jump hashing numbers its buckets, so the queues are laid out in name order;
    only a change at the end of that order is minimal.
    """

    def __init__(self, w: dict[str, float], per_weight: int) -> None:
        self.names = sorted(w)
        self.bounds = list(accumulate(max(1, round(per_weight * w[q])) for q in self.names))

    def lookup_hash(self, h: int) -> str:
        return self.names[bisect_right(self.bounds, jump_bucket(h, self.bounds[-1]))]


def jump_alternative(seed: int, repeats: int) -> dict[str, Any]:
    """Weighted jump hashing: moved fractions (sampled) and cost against the table, alternated."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(20_000)]
    remaps = []
    for n in (16, 256):
        w: dict[str, float] = dict(quality_weights(n))
        names = sorted(w)
        base = WeightedJump(w, 100)
        before = [base.lookup_hash(h) for h in hashes]
        changes = []
        for label, name in (
            ("remove first", names[0]),
            ("remove middle", names[n // 2]),
            ("remove last", names[-1]),
            ("add one, first in name order", "a-new"),
            ("add one, last in name order", "z-new"),
        ):
            if label.startswith("add"):
                other = {**w, name: 2.0}
            else:
                other = {q: v for q, v in w.items() if q != name}
            changed = WeightedJump(other, 100)
            moved = sum(a != changed.lookup_hash(h) for a, h in zip(before, hashes, strict=True))
            ideal = ideal_moved_fraction(HashRing(w), HashRing(other))
            changes.append({"change": label, "moved_sampled": moved / len(hashes),
                            "ideal": ideal, "ratio": moved / len(hashes) / ideal})  # fmt: skip
        remaps.append({"queues": n, "virtual_buckets_per_weight": 100, "changes": changes})
    # Cost per lookup, jump against the table on the same hashes, alternated.
    costs: dict[str, list[float]] = {}
    lookups: dict[str, Callable[[int], str]] = {}
    for n in QUEUE_COUNTS:
        lookups[f"jump_{n}"] = WeightedJump(dict(weights(n)), 100).lookup_hash
        lookups[f"table_{n}"] = HashRing(weights(n), algorithm="table").lookup_hash
    sample = hashes[:5_000]
    for rep in range(repeats):
        order = list(lookups)
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for name in order:
            lookup = lookups[name]
            start = time.perf_counter()
            for h in sample:
                lookup(h)
            costs.setdefault(name, []).append((time.perf_counter() - start) / len(sample) * 1e6)
    return {
        "remaps": remaps,
        "us_per_lookup_hash": {name: summary(values) for name, values in costs.items()},
    }


# -- 4. apply_async against a real Redis -----------------------------------------------------


def _app(broker: str, router: ConsistentHashRouter | None) -> Celery:
    app = Celery("bench_router", broker=broker, set_as_current=False)
    if router is not None:
        app.conf.task_routes = (router,)

    @app.task(name="bench.task", shared=False)
    def task(n: int, tenant_id: str | None = None) -> int:
        return n

    return app


def apply_async_overhead(calls: int, repeats: int) -> dict[str, Any]:
    """Per-call cost of apply_async with and without the router; ratios within a repetition."""
    tenants = [f"tenant-{i:04d}" for i in range(500)]
    with RedisServer() as server:
        variants: dict[str, Celery] = {
            "plain": _app(server.url, None),
            "router_4q": _app(server.url, ConsistentHashRouter(weights(4), key="tenant_id")),
            "router_4q_no_memo": _app(
                server.url, ConsistentHashRouter(weights(4), key="tenant_id", cache_size=0)
            ),
            "router_256q_rendezvous_no_memo": _app(
                server.url, ConsistentHashRouter(weights(256), key="tenant_id", cache_size=0)
            ),
            "router_256q_table_no_memo": _app(
                server.url,
                ConsistentHashRouter(
                    weights(256), key="tenant_id", cache_size=0, algorithm="table"
                ),
            ),
            # Rendezvous at 10,000 queues (6 ms a call) would dominate the run: table only.
            "router_10000q_table_no_memo": _app(
                server.url,
                ConsistentHashRouter(
                    weights(10_000), key="tenant_id", cache_size=0, algorithm="table"
                ),
            ),
        }
        flush = variants["plain"].connection_for_write()
        client = flush.default_channel.client
        # Only the task lists are emptied between runs: FLUSHDB would also drop Kombu's
        # binding tables, which it declares once per connection and never again.
        task_lists = ["celery", *weights(10_000)]
        for app in variants.values():  # warm up connections and the producer pool
            for i in range(200):
                app.tasks["bench.task"].apply_async((i,), {"tenant_id": tenants[i % 500]})
        per_call: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(repeats):
            # Alternate the variants, rotating who goes first, so drift hits all alike.
            order = list(variants)
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for name in order:
                for chunk in range(0, len(task_lists), 1000):
                    client.delete(*task_lists[chunk : chunk + 1000])
                task = variants[name].tasks["bench.task"]
                start = time.perf_counter()
                for i in range(calls):
                    task.apply_async((i,), {"tenant_id": tenants[i % 500]})
                per_call[name].append((time.perf_counter() - start) / calls)
        flush.release()
        for app in variants.values():
            app.close()
    plain = per_call["plain"]
    result: dict[str, Any] = {"calls_per_repetition": calls, "repetitions": repeats}
    for name, samples in per_call.items():
        ratios = [s / p for s, p in zip(samples, plain, strict=True)]
        result[name] = {
            "us_per_call_median": statistics.median(samples) * 1e6,
            "us_per_call_min": min(samples) * 1e6,
            "us_per_call_max": max(samples) * 1e6,
            "ratio_to_plain_median": statistics.median(ratios),
            "ratio_to_plain_min": min(ratios),
            "ratio_to_plain_max": max(ratios),
        }
    return result


# -- report ----------------------------------------------------------------------------------


def _rate(cell: dict[str, float]) -> str:
    return f"{cell['median']:,.0f} [{cell['min']:,.0f}, {cell['max']:,.0f}]"


def _us(cell: dict[str, float]) -> str:
    # cost per decision in microseconds: median of the rates inverted, with the range
    return f"{1e6 / cell['median']:.2f} [{1e6 / cell['max']:.2f}, {1e6 / cell['min']:.2f}]"


def to_markdown(report: dict[str, Any]) -> str:
    dec = report["decisions"]
    env = report["environment"]
    lines = [
        "# Consistent-hash routing benchmark",
        "",
        f"`{report['command']}` on {report['machine']}, {env['cpus']} CPUs, Python "
        f"{env['python']}, {env['when']}. Medians over {dec['repetitions']} repetitions, "
        "with [min, max]; "
        "variants alternated within each repetition; every repetition routes fresh keys "
        "(keys never repeat, the router's memo is off) except the memo column.",
        "",
        f"The run took {sum(report['seconds_per_step'].values()):.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in report['seconds_per_step'].items())}).",
        "",
        "## Cost per routing decision",
        "",
        "Router calls as Celery makes them (`router(name, args, kwargs, options)`, "
        "`cache_size=0`), in microseconds per decision. `auto` (opt-in; the default stays "
        "`rendezvous`): rendezvous up to 12 queues, the probe table above.",
        "",
        "| queues | `auto` | `rendezvous` | `table` | `auto`, 1,000 tenants, memo |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in dec["rows"]:
        lines.append(
            f"| {row['queues']:,} (auto = {row['auto_resolves_to']}) "
            f"| {_us(row['router_auto_no_memo'])} | {_us(row['router_rendezvous_no_memo'])} "
            f"| {_us(row['router_table_no_memo'])} | {_us(row['router_1000_tenants_memo'])} |"
        )
    lines += [
        "",
        "Bare ring lookups (`HashRing.lookup`), decisions per second:",
        "",
        "| queues | `auto` | `rendezvous` | `table` |",
        "|---:|---:|---:|---:|",
    ]
    for row in dec["rows"]:
        lines.append(
            f"| {row['queues']:,} | {_rate(row['ring_auto'])} | {_rate(row['ring_rendezvous'])} "
            f"| {_rate(row['ring_table'])} |"
        )
    lines += [
        "",
        "Cost at 10,000 queues divided by cost at 4, paired within each repetition "
        "(the acceptance bound is 3):",
        "",
        "| measured | ratio |",
        "|---|---:|",
    ]
    for name, cell in dec["cost_ratio_10000_vs_4"].items():
        lines.append(
            f"| {name.replace('_', ', ')} | {cell['median']:.2f} "
            f"[{cell['min']:.2f}, {cell['max']:.2f}] |"
        )
    lines += [
        "",
        "## The table: size, build time, memory, weight change",
        "",
        "*build*: a fresh build (memo cleared), 3 times; *memoised*: the same queues "
        "listed in reverse order, served from the memo; *RSS kept* and *RSS peak*: "
        "resident memory the build adds, and its peak above the start, in a fresh "
        "interpreter; *with_weight*: one weight changed, a new table.",
        "",
        "| queues | total weight (band top) | slots per weight | slots | buckets "
        "| build s | memoised s | RSS kept MB | RSS peak MB | `with_weight` s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["table_costs"]:
        b = row["build_seconds"]
        m = row["memoised_build_seconds"]
        lines.append(
            f"| {row['queues']:,} | {row['total_weight']:,} ({row['band_top']:,.0f}) "
            f"| {row['slots_per_weight']:g} | {row['slots']:,} | {row['buckets']:,} "
            f"| {b['median']:.3f} [{b['min']:.3f}, {b['max']:.3f}] "
            f"| {m['median']:.4f} [{m['min']:.4f}, {m['max']:.4f}] "
            f"| {row['memory_retained_mb']:.1f} | {row['memory_peak_mb']:.1f} "
            f"| {row['with_weight_seconds']:.3f} |"
        )
    lines += [
        "",
        "## Quality: rendezvous (before) against the table (after), same keys",
        "",
        "Weights 1, 1, 2, 2 at 4 queues, 1, 2, 3, 4, 1, ... above. *sampled*: over the "
        "keys of the run (the 4.5-sigma binomial band of the smallest queue's share is "
        "given where the smallest queue expects 100 keys or more); *exact*: computed from "
        "the table itself, free of sampling noise "
        "(`HashRing.mapped_shares`; for rendezvous the weight shares, exact by "
        "construction). Moved fractions are divided by the least any mapping must move. "
        "Rendezvous at 10,000 queues costs 6 ms a key, so only its exact figures are given.",
        "",
        "| queues | algorithm | keys | chi-square (dof) | p | worst share error sampled (band) "
        "| worst share error exact |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for e in report["quality"]:
        if e["keys"]:
            sampled = (
                f"{e['worst_share_error_sampled']:.2%} ({e['sampling_band']:.2%})"
                if "sampling_band" in e
                else "-"
            )
            p = f"{e['chi2_pvalue']:.3f}"
            chi2 = f"{e['chi2_statistic']:,.1f} ({e['chi2_dof']:,})"
        else:
            sampled, p, chi2 = "-", "-", "-"
        lines.append(
            f"| {e['queues']:,} | {e['algorithm']} | {e['keys']:,} | {chi2} | {p} | {sampled} "
            f"| {e['worst_share_error_exact']:.2%} |"
        )
    lines += [
        "",
        "Removing queue *q* moves exactly *q*'s keys under both mappings, so over all the "
        "queues of a ring the moved / ideal ratio of a removal is *q*'s mapped share over "
        "its weight share (exact):",
        "",
        "| queues | algorithm | min | 1st pct | median | 99th pct | max | queues above 1.05 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in report["quality"]:
        r = e["removal_ratio_all_queues"]
        lines.append(
            f"| {e['queues']:,} | {e['algorithm']} | {r['min']:.3f} | {r['p01']:.3f} "
            f"| {r['median']:.3f} | {r['p99']:.3f} | {r['max']:.3f} "
            f"| {r['share_above_1_05']:.1%} |"
        )
    lines += [
        "",
        "The four changes of the acceptance test, sampled on the run's keys and exact:",
        "",
        "| queues | algorithm | change | ideal | moved / ideal, sampled | moved / ideal, exact "
        "| only the changed queue involved |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for e in report["quality"]:
        for c in e["changes"]:
            sampled = f"{c['ratio_sampled']:.3f}" if "ratio_sampled" in c else "-"
            only = {True: "yes", False: "NO"}.get(c.get("only_changed_queue"), "-")
            lines.append(
                f"| {e['queues']:,} | {e['algorithm']} | {c['change']} | {c['ideal']:.4%} "
                f"| {sampled} | {c['ratio_exact']:.3f} | {only} |"
            )
    if "alternatives" in report:
        lines += _maglev_markdown(report)
    lines += _migration_markdown(report)
    if "jump" in report:
        lines += _jump_markdown(report)
    return "\n".join(lines) + "\n"


def _maglev_markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Alternative measured: weighted Maglev",
        "",
        "Moved fraction of the table's entries (= of uniformly hashed keys) over the ideal.",
        "",
        "| queues | table size | build s | worst share error | remove first | remove middle "
        "| remove last | add one |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["alternatives"]:
        ratios = " | ".join(f"{c['ratio']:.2f}" for c in row["changes"])
        lines.append(
            f"| {row['queues']} | {row['table_size']:,} | {row['build_seconds']:.2f} "
            f"| {row['worst_share_error']:.2%} | {ratios} |"
        )
    return lines


def _migration_markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Migration: switching a ring from rendezvous to the table",
        "",
        "Keys whose queue differs between the two mappings (same keys as above), against "
        "what two unrelated mappings would differ on, 1 - sum of squared shares:",
        "",
        "| queues | keys | moved by the switch | unrelated mappings |",
        "|---:|---:|---:|---:|",
    ]
    for e in report["quality"]:
        switch = e.get("switch_from_rendezvous")
        if switch:
            lines.append(
                f"| {e['queues']:,} | {switch['keys']:,} | {switch['moved_sampled']:.2%} "
                f"| {switch['unrelated_mappings']:.2%} |"
            )
    return lines


def _jump_markdown(report: dict[str, Any]) -> list[str]:
    jump = report["jump"]
    lines = [
        "",
        "## Alternative measured: weighted jump consistent hash",
        "",
        "100 virtual buckets per unit of weight, queues in name order; 20,000 sampled keys; "
        "moved fraction over the ideal.",
        "",
        "| queues | remove first | remove middle | remove last "
        "| add one, first in name order | add one, last in name order |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in jump["remaps"]:
        ratios = " | ".join(f"{c['ratio']:.2f}" for c in row["changes"])
        lines.append(f"| {row['queues']} | {ratios} |")
    lines += [
        "",
        "Cost per `lookup_hash` (µs, the key hash excluded), alternated with the table:",
        "",
        "| queues | weighted jump | table |",
        "|---:|---:|---:|",
    ]
    costs = jump["us_per_lookup_hash"]
    for n in QUEUE_COUNTS:
        j, t = costs[f"jump_{n}"], costs[f"table_{n}"]
        lines.append(
            f"| {n:,} | {j['median']:.2f} [{j['min']:.2f}, {j['max']:.2f}] "
            f"| {t['median']:.2f} [{t['min']:.2f}, {t['max']:.2f}] |"
        )
    return lines


def apply_async_markdown(report: dict[str, Any]) -> str:
    ov = report["apply_async"]
    env = report["environment"]
    lines = [
        "# Consistent-hash routing: added cost on `apply_async` to a real Redis",
        "",
        f"`{report['command']}` on {report['machine']}, {env['cpus']} CPUs, Python "
        f"{env['python']}, Celery {env['celery']}, {env['when']}. {ov['repetitions']} "
        f"repetitions of {ov['calls_per_repetition']} calls per variant, variants alternated "
        "within each repetition; ratio = variant / plain in the same repetition; medians "
        "with [min, max]. Routers without an algorithm in their name use the default, "
        "rendezvous.",
        "",
        "| variant | µs per call | ratio to plain |",
        "|---|---:|---:|",
    ]
    for name, v in ov.items():
        if not isinstance(v, dict):
            continue
        lines.append(
            f"| {name} | {v['us_per_call_median']:.1f} [{v['us_per_call_min']:.1f}, "
            f"{v['us_per_call_max']:.1f}] | {v['ratio_to_plain_median']:.3f} "
            f"[{v['ratio_to_plain_min']:.3f}, {v['ratio_to_plain_max']:.3f}] |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__)
    parser.add_argument("--keys", type=int, default=20_000, help="keys per decision run")
    parser.add_argument("--calls", type=int, default=2_000, help="apply_async calls per run")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions")
    parser.add_argument("--seed", type=int, default=20240501, help="seed of the quality keys")
    parser.add_argument(
        "--apply-async",
        action="store_true",
        help="run only the real-Redis apply_async section (results in router.apply_async.*)",
    )
    parser.add_argument(
        "--alternatives",
        action="store_true",
        help="also measure the rejected weighted Maglev and jump hash mappings (docs/routing.md)",
    )
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.router", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {
        "command": command,
        "machine": f"{platform.machine()} {platform.system()}",
        "environment": environment(),
    }
    if args.apply_async:
        report["apply_async"] = apply_async_overhead(args.calls, args.repeats)
        markdown = apply_async_markdown(report)
        write("router.apply_async", report, markdown)
        print(markdown)
        return 0
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("decisions", lambda: decisions_per_second(args.keys, args.repeats)),
        ("table_costs", lambda: table_costs(3)),
        ("quality", lambda: quality(args.seed)),
    ]
    if args.alternatives:
        steps += [
            ("alternatives", alternatives),
            ("jump", lambda: jump_alternative(args.seed, args.repeats)),
        ]
    seconds: dict[str, float] = {}
    for name, step in steps:
        start = time.perf_counter()
        report[name] = step()
        seconds[name] = time.perf_counter() - start
        print(f"{name}: {seconds[name]:.0f} s", flush=True)
    report["seconds_per_step"] = seconds
    markdown = to_markdown(report)
    write("router", report, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
