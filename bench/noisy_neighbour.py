"""The noisy-neighbour showcase (issue #8): plain Celery against celery-fair, four scenarios.

A flood, B heavy tasks, C tiers, D slow worker; real ``celery worker -P prefork
-c 2`` processes on a real Redis or RabbitMQ; the modes alternate within each
repetition. Results: ``bench/results/noisy_neighbour_<broker>.{json,md,png}``.
The scenario logic lives in :mod:`celery_fair.showcase`.

    python -m bench.noisy_neighbour [--broker redis|rabbitmq] [--scenarios A,B,C,D]
                                    [--reps 3] [--quick] [--flood 20000]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from celery_fair.showcase.runner import LABELS, Live, ShowcaseConfig, run_showcase, server_for
from celery_fair.showcase.summary import markdown, summarise, write_chart
from celery_fair.testing.redis import RedisServer

from .common import RESULTS, environment, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--scenarios", default="A,B,C,D", help="comma-separated, e.g. A,D")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the demo's short versions")
    parser.add_argument("--flood", type=int, default=None, help="scenario A's burst size")
    parser.add_argument("--name", default=None, help="result file name")
    args = parser.parse_args(argv)
    scenarios = tuple(s.strip().upper() for s in args.scenarios.split(",") if s.strip())
    config = (ShowcaseConfig.quick if args.quick else ShowcaseConfig)(
        scenarios=scenarios, reps=args.reps
    )
    if args.flood is not None:
        config = replace(config, flood=replace(config.flood, flood=args.flood))
    name = args.name or f"noisy_neighbour_{args.broker}" + ("_quick" if args.quick else "")
    live = Live()
    with RedisServer() as ledger_server, server_for(args.broker) as broker:
        live.line(f"{args.broker} on 127.0.0.1, ledger on its own redis-server; {name}")
        runs = run_showcase(config, broker.url, ledger_server.url, live)
    summary = summarise(runs)
    results: dict[str, Any] = {
        "env": environment(),
        "broker": args.broker,
        "config": config.to_dict(),
        "summary": summary,
        "runs": runs,
    }
    chart = None
    if "A" in summary:
        chart = f"{name}.png"
        write_chart(
            summary, LABELS, RESULTS / chart,
            title=f"Scenario A on {args.broker}: quiet tenants' wait during a "
                  f"{config.flood.flood:,}-task flood (medians of {args.reps} runs)",
        )  # fmt: skip
    flags = f"--broker {args.broker} --scenarios {','.join(scenarios)} --reps {args.reps}"
    flags += " --quick" if args.quick else ""
    loads = [r["load"] for modes in runs.values() for reps in modes.values() for r in reps]
    text = "\n".join(
        [
            f"# Noisy neighbour ({args.broker})",
            "",
            f"Reproduce: `python -m bench.noisy_neighbour {flags}` ({results['env']['when']}, "
            f"celery {results['env']['celery']}, kombu {results['env']['kombu']}, "
            f"{results['env']['cpus']} CPUs shared with other work: 1-minute load average "
            f"{min(loads):.1f} to {max(loads):.1f} during the runs). Medians over "
            f"{args.reps} repetitions, [min, max]; the modes alternate within each repetition.",
            "",
            _setup(config),
            "",
            markdown(summary, LABELS, chart=chart),
        ]
    )
    write(name, results, text)
    print(text)
    return 0


def _setup(config: ShowcaseConfig) -> str:
    f, d, b, c = config.flood, config.slow, config.heavy, config.tiers
    lay = config.layout
    return (
        f"Setup: {len(lay.quiet)} quiet tenants at {f.rate:g} tasks/s each and one flooding "
        f"tenant, routed by `tenant_id` with `ConsistentHashRouter` onto {len(lay.shards)} "
        f"shard queues ({lay.flood} -> {lay.flood_shard}, shared with "
        f"{', '.join(lay.neighbours) or 'no quiet tenant'}). Tasks sleep {f.task_ms:g} ms. "
        f"A: one worker `-P prefork -c {f.concurrency}`, {f.baseline:g} s unloaded, then a "
        f"burst of {f.flood:,} tasks. D: two workers `-c {d.concurrency}`, a {d.flood:,}-task "
        f"burst, from which one worker's tasks take {d.task_ms + d.slow_ms:g} ms. "
        f"B: tasks busy the CPU {b.heavy_us / 1000:g} ms (heavy tenant) and "
        f"{b.light_us / 1000:g} ms ({b.light} light tenants), {b.target:,} tasks measured. "
        f"C: {c.premium} premium and {c.standard} standard shards weighted {c.weight}:1, "
        f"{c.task_ms:g} ms tasks, {c.target:,} tasks measured."
    )


if __name__ == "__main__":
    sys.exit(main())
