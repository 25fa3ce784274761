"""Throughput cost of worker telemetry (``fair_telemetry_dir``).

celery-fair with and without telemetry on the same workload (10 queues,
quanta 4..40, ``-P prefork -c 2``, no-op tasks: the worst case, where the
per-task record is largest relative to the task), alternating, several
repetitions.  Target: within 3% of throughput.

    python -m bench.telemetry_overhead [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from celery_fair.testing.harness import run_backlogged
from celery_fair.testing.redis import RedisServer

from .common import environment, summary, write

QUANTA = {f"p{i}": 4 * (i + 1) for i in range(10)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--per-queue", type=int, default=3000)
    parser.add_argument("--target", type=int, default=12000)
    parser.add_argument("--task-us", type=int, default=0)
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    weights = ",".join(f"{q}={w}" for q, w in QUANTA.items())
    with RedisServer() as redis, tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                env = {"CELERY_FAIR_WEIGHTS": weights}
                if mode == "on":
                    env["CELERY_FAIR_TELEMETRY_DIR"] = f"{tmp}/rep{rep}"
                res = run_backlogged(
                    redis.url, dict.fromkeys(QUANTA, args.per_queue), target=args.target,
                    warmup=300, args=(args.task_us,), env=env,
                )  # fmt: skip
                rates[mode].append(res.rate)
                print(f"rep {rep} telemetry {mode:3} {res.rate:7.0f} tasks/s", flush=True)
    results: dict[str, Any] = {
        "env": environment(),
        "params": vars(args),
        "off": summary(rates["off"]),
        "on": summary(rates["on"]),
        "runs": rates,
    }
    results["ratio"] = results["on"]["median"] / results["off"]["median"]
    lines = [
        "# Telemetry overhead (Redis, real worker)",
        "",
        f"Reproduce: `python -m bench.telemetry_overhead` ({results['env']['when']}, "
        f"-P prefork -c 2, {args.task_us} us tasks, {args.reps} alternating repetitions).",
        "",
        "| telemetry | tasks/s median [min, max] |",
        "|---|---|",
    ]
    for mode in ("off", "on"):
        r = results[mode]
        lines.append(f"| {mode} | {r['median']:.0f} [{r['min']:.0f}, {r['max']:.0f}] |")
    lines += ["", f"Throughput with telemetry: {results['ratio']:.1%} of without."]
    write("telemetry_overhead", results, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
