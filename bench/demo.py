"""``make demo``: the noisy-neighbour showcase, plain Celery against celery-fair, in a few minutes.

Starts its own ``redis-server`` on a free loopback port (and a second one
for the run ledger), then runs short versions of the four scenarios of
:mod:`bench.showcase` with real ``celery worker -P prefork -c 2``
processes, plain Celery and celery-fair side by side:

A. a flood: one tenant bursts 3,000 tasks while 20 quiet tenants trickle;
B. heavy tasks: one tenant's tasks take 10x longer;
C. tiers: premium and standard shards weighted 4:1;
D. a slow worker: one of two workers slows down 10x during a flood.

It shows live progress, ends with side-by-side tables and a PNG chart of
the quiet tenants' waits, and runs ``celery-fair report`` (Spark) on the
telemetry the celery-fair workers wrote. Everything goes to ``--out``
(default ``demo-output/``). The full-size benchmark is ``bench/noisy_neighbour.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.showcase.runner import LABELS, Live, ShowcaseConfig, run_showcase
from bench.showcase.summary import markdown, summarise, terminal, write_chart
from tests.harness.redis import RedisServer


def _explain(config: ShowcaseConfig) -> list[str]:
    lay = config.layout
    return [
        f"{len(lay.quiet)} quiet tenants send {config.flood.rate:g} tasks/s each; "
        f"'{lay.flood}' bursts {config.flood.flood:,} tasks.",
        f"Tasks are routed by tenant_id with celery_fair.ConsistentHashRouter onto "
        f"{len(lay.shards)} shards; the flood lands on {lay.flood_shard}, shared with "
        f"{', '.join(lay.neighbours) or 'nobody'}.",
        "Compared: plain Celery with one shared queue, plain Celery with the same shards "
        "(polled round-robin), and celery-fair (DWRR over the shards).",
        "K: the same tenants in one queue keyed by tenant_id (fair_keys): fairness between "
        "the tenants of one queue, against plain Celery's FIFO.",
    ]


def _report(telemetry: Path, out: Path, live: Live) -> int:
    """Run ``celery-fair report`` on the telemetry; returns its exit status."""
    if not any(telemetry.rglob("*.parquet")):
        live.line("no telemetry was written; skipping the report")
        return 1
    live.line("")
    live.line(f"celery-fair report {telemetry} --out {out} (Spark, local mode):")
    cmd = [sys.executable, "-m", "celery_fair.cli", "report", str(telemetry), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(proc.stdout.rstrip())
    print(
        "(target = a shard's weight share when every shard is backlogged; DWRR is "
        "work-conserving, so the flood's shard takes what the idle shards leave.)"
    )
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the noisy-neighbour showcase, in a few minutes")
    parser.add_argument("--out", default="demo-output", help="directory for tables, PNG, report")
    parser.add_argument("--scenarios", default="A,K,B,C,D")
    parser.add_argument("--flood", type=int, default=None, help="scenario A's burst size")
    parser.add_argument("--no-report", action="store_true", help="skip the Spark report")
    args = parser.parse_args(argv)
    out = Path(args.out)
    telemetry = out / "telemetry"
    shutil.rmtree(telemetry, ignore_errors=True)
    telemetry.mkdir(parents=True, exist_ok=True)
    scenarios = tuple(s.strip().upper() for s in args.scenarios.split(",") if s.strip())
    config = ShowcaseConfig.quick(
        scenarios=scenarios, reps=1, telemetry_dir=str(telemetry.resolve())
    )
    if args.flood:
        config = replace(config, flood=replace(config.flood, flood=args.flood))
    live = Live()
    started = time.monotonic()
    live.line("celery-fair demo: the noisy neighbour, plain Celery vs celery-fair")
    for line in _explain(config):
        live.line("  " + line)
    with RedisServer() as broker, RedisServer() as ledger:
        live.line(f"  started redis-server on 127.0.0.1:{broker.port} (ledger on :{ledger.port})")
        live.line("")
        runs = run_showcase(config, broker.url, ledger.url, live)
    summary = summarise(runs)
    print(terminal(summary, LABELS))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(markdown(summary, LABELS, chart="quiet_tenant_waits.png"))
    print()
    if "A" in summary:
        chart = write_chart(
            summary, LABELS, out / "quiet_tenant_waits.png",
            title=f"Quiet tenants' wait during a {config.flood.flood:,}-task flood (Redis)",
        )  # fmt: skip
        print(f"chart: {chart}")
    print(f"tables: {out / 'summary.md'}")
    status = 0 if args.no_report else _report(telemetry, out / "report", live)
    print()
    _conclusions(summary)
    print(f"\ndemo finished in {time.monotonic() - started:.0f} s. Full-size benchmarks with")
    print("repetitions: python -m bench.noisy_neighbour --broker redis|rabbitmq (see README).")
    return status


def _conclusions(summary: dict[str, Any]) -> None:
    """What the tables mean, in one line per scenario."""
    if "A" in summary:
        modes = summary["A"]["modes"]
        if {"plain-shared", "fair"} <= set(modes):
            shared = modes["plain-shared"]["quiet_others.p99"]["median"]
            fair = modes["fair"]["quiet_others.p99"]["median"]
            print(
                f"A: quiet tenants' p99 wait {shared:.2f} s with one shared queue, "
                f"{fair * 1000:.0f} ms with celery-fair; tenants on the flood's shard still "
                "queue behind it (give a noisy tenant its own queue, or use more shards)."
            )
    if "B" in summary and "fair-runtime" in summary["B"]["modes"]:
        heavy = summary["B"]["modes"]
        print(
            "B: the heavy tenant's share of worker time: "
            f"{heavy['plain-sharded']['time_share']['b-heavy']['median']:.0%} round-robin by "
            f"count, {heavy['fair-runtime']['time_share']['b-heavy']['median']:.0%} with "
            'fair_cost="runtime" (4 tenants: 25% is fair).'
        )
    if "C" in summary and "fair" in summary["C"]["modes"]:
        tiers = summary["C"]["modes"]
        print(
            f"C: premium tier {tiers['plain-sharded']['premium_share']['median']:.0%} "
            f"round-robin, {tiers['fair']['premium_share']['median']:.0%} with weights 4:1 "
            "(target 80%)."
        )
    if "K" in summary and {"plain-shared", "fair-keyed"} <= set(summary["K"]["modes"]):
        k = summary["K"]["modes"]
        fifo, keyed = k["plain-shared"], k["fair-keyed"]
        print(
            f"K: one queue for every tenant: quiet tenants' p99 wait "
            f"{fifo['quiet_others.p99']['median']:.2f} s FIFO, "
            f"{keyed['quiet_others.p99']['median'] * 1000:.0f} ms keyed by tenant "
            f"(the flood's shard neighbours {keyed['neighbours.p99']['median'] * 1000:.0f} ms); "
            f"{keyed['within_2x']['median']:.0f}/{keyed['quiet']} quiet "
            f"tenants within 2x of unloaded; flood {keyed['flood.throughput']['median']:.0f}/s "
            f"against {fifo['flood.throughput']['median']:.0f}/s FIFO"
            + (
                f", {k['plain-sharded']['flood.throughput']['median']:.0f}/s sharded."
                if "plain-sharded" in k
                else "."
            )
        )
    if "D" in summary:
        d = summary["D"]["modes"]
        parts = [f"{m} {v['quiet_others.p99']['median'] * 1000:.0f} ms" for m, v in d.items()]
        print("D: quiet tenants' p99 wait with a slow worker: " + ", ".join(parts) + ".")


if __name__ == "__main__":
    sys.exit(main())
