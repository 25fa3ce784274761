"""Benchmark of consistent-hash routing: decisions per second, and the cost added to apply_async.

Run with ``python -m bench.router``. Writes ``bench/results/router.json`` and
``bench/results/router.md``. Two measurements:

1. Routing decisions per second with 4, 16 and 256 queues: the bare ring on
   distinct keys, and the router (as Celery calls it) on distinct keys
   without its memo and on 1,000 recurring tenants with it.
2. ``apply_async`` to a real Redis (started here) with plain Celery routing
   against the same call through ``ConsistentHashRouter``, variants
   alternated within each repetition; the median and the spread of the
   per-repetition ratios are reported. The target is at most 5% added cost.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from celery_fair.routing import ConsistentHashRouter, HashRing
from celery_fair.testing.redis import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
QUEUE_COUNTS = (4, 16, 256)


def weights(n: int) -> dict[str, int]:
    return {f"q{i:03d}": 1 + i % 4 for i in range(n)}


def _rate(fn: Callable[[list[str]], object], keys: list[str], repeats: int) -> dict[str, float]:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(keys)
        rates.append(len(keys) / (time.perf_counter() - start))
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def decisions_per_second(n_keys: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    distinct = [f"tenant-{i:08d}" for i in range(n_keys)]
    recurring = [f"tenant-{i % 1000:04d}" for i in range(n_keys)]
    for n in QUEUE_COUNTS:
        ring = HashRing(weights(n))
        uncached = ConsistentHashRouter(ring, key="tenant_id", cache_size=0)
        cached = ConsistentHashRouter(ring, key="tenant_id")

        def via_ring(keys: list[str], ring: HashRing = ring) -> None:
            for k in keys:
                ring.lookup(k)

        def via_router(keys: list[str], router: ConsistentHashRouter) -> None:
            for k in keys:
                router("bench.task", (), {"tenant_id": k}, {})

        keys_n = distinct if n <= 16 else distinct[: max(1, n_keys // 10)]
        rows.append(
            {
                "queues": n,
                "ring_distinct_keys": _rate(via_ring, keys_n, repeats),
                "router_distinct_keys_no_memo": _rate(
                    lambda ks, r=uncached: via_router(ks, r), keys_n, repeats
                ),
                "router_1000_tenants_memo": _rate(
                    lambda ks, r=cached: via_router(ks, r), recurring, repeats
                ),
            }
        )
    return rows


def _app(broker: str, router: ConsistentHashRouter | None) -> Celery:
    app = Celery("bench_router", broker=broker, set_as_current=False)
    app.conf.task_ignore_result = True
    if router is not None:
        app.conf.task_routes = (router,)

    @app.task(name="bench.task", shared=False)
    def task(seq: int, tenant_id: str | None = None) -> None:
        return None

    return app


def apply_async_overhead(calls: int, repeats: int) -> dict[str, Any]:
    tenants = [f"tenant-{i:04d}" for i in range(500)]
    with RedisServer() as server:
        variants: dict[str, Celery] = {
            "plain": _app(server.url, None),
            "router_4q": _app(server.url, ConsistentHashRouter(weights(4), key="tenant_id")),
            "router_4q_no_memo": _app(
                server.url, ConsistentHashRouter(weights(4), key="tenant_id", cache_size=0)
            ),
            "router_256q_no_memo": _app(
                server.url, ConsistentHashRouter(weights(256), key="tenant_id", cache_size=0)
            ),
        }
        flush = variants["plain"].connection_for_write()
        client = flush.default_channel.client
        # Only the task lists are emptied between runs: FLUSHDB would also drop Kombu's
        # binding tables, which it declares once per connection and never again.
        task_lists = ["celery", *weights(256)]
        for app in variants.values():  # warm up connections and the producer pool
            for i in range(200):
                app.tasks["bench.task"].apply_async((i,), {"tenant_id": tenants[i % 500]})
        per_call: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(repeats):
            # Alternate the variants, rotating who goes first, so drift hits all alike.
            order = list(variants)
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for name in order:
                client.delete(*task_lists)
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


def to_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Consistent-hash routing benchmark",
        "",
        f"`python -m bench.router` on {report['machine']}, Python {report['python']}.",
        "Medians of the repetitions, with [min, max].",
        "",
        "## Routing decisions per second",
        "",
        "| queues | ring, distinct keys | router, distinct keys, no memo "
        "| router, 1,000 tenants, memo |",
        "|---:|---:|---:|---:|",
    ]
    for row in report["decisions"]:
        cells = [
            f"{row[k]['median']:,.0f} [{row[k]['min']:,.0f}, {row[k]['max']:,.0f}]"
            for k in ("ring_distinct_keys", "router_distinct_keys_no_memo",
                      "router_1000_tenants_memo")
        ]  # fmt: skip
        lines.append(f"| {row['queues']} | " + " | ".join(cells) + " |")
    ov = report["apply_async"]
    lines += [
        "",
        "## Added cost on `apply_async` to a real Redis",
        "",
        f"{ov['repetitions']} repetitions of {ov['calls_per_repetition']} calls per variant, "
        "variants alternated within each repetition; ratio = variant / plain in the same "
        "repetition.",
        "",
        "| variant | µs per call | ratio to plain |",
        "|---|---:|---:|",
    ]
    for name in ("plain", "router_4q", "router_4q_no_memo", "router_256q_no_memo"):
        v = ov[name]
        lines.append(
            f"| {name} | {v['us_per_call_median']:.1f} [{v['us_per_call_min']:.1f}, "
            f"{v['us_per_call_max']:.1f}] | {v['ratio_to_plain_median']:.3f} "
            f"[{v['ratio_to_plain_min']:.3f}, {v['ratio_to_plain_max']:.3f}] |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__)
    parser.add_argument("--keys", type=int, default=50_000, help="keys per decision run")
    parser.add_argument("--calls", type=int, default=2_000, help="apply_async calls per run")
    parser.add_argument("--repeats", type=int, default=9, help="repetitions")
    args = parser.parse_args(argv)
    report = {
        "machine": f"{platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        "decisions": decisions_per_second(args.keys, args.repeats),
        "apply_async": apply_async_overhead(args.calls, args.repeats),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "router.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(report)
    (RESULTS / "router.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
