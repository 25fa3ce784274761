"""Bounded memory: the worker's main process while it drains 100,000 queued tasks.

Redis holds 100,000 no-op tasks over four queues; one ``celery worker -P
prefork -c 2`` drains them while its main process's RSS is sampled.  Plain
Celery and celery-fair (weights 1:2:3:4, ``fair_cost="runtime"`` so every
task is followed to its end, and Prometheus metrics on) run in the same
session on the same backlog; RSS after start-up (1,000 tasks in) is compared
with the peak while draining.

    python -m bench.memory [--tasks 100000] [--reps 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any

import redis as redis_lib

from tests.harness.harness import fill_queues
from tests.harness.memory import MemoryRun, drain_and_sample
from tests.harness.redis import RedisServer, free_port

from .common import environment, write

QUEUES = {"b1": 1, "b2": 2, "b3": 3, "b4": 4}
MIB = 1024 * 1024


def one_run(url: str, fair: bool, tasks: int) -> MemoryRun:
    redis_lib.Redis.from_url(url).flushdb()
    fill_queues(url, dict.fromkeys(QUEUES, tasks // len(QUEUES)), task="work", args=(0,))
    env = {"CELERY_FAIR_COST": "runtime", "CELERY_FAIR_METRICS_PORT": str(free_port())}
    weights = ",".join(f"{q}={w}" for q, w in QUEUES.items())
    return drain_and_sample(
        url,
        list(QUEUES),
        drain=tasks - 100,  # the last hundred: the queues stop being backlogged
        warmup=1000,
        fair=fair,
        env=env if fair else {},
        extra_args=["--fair-weights", weights] if fair else [],
        timeout=900,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args(argv)
    runs: dict[str, list[MemoryRun]] = {"plain": [], "fair": []}
    load_before = os.getloadavg()
    with RedisServer() as server:
        for rep in range(args.reps):
            for mode in ("plain", "fair") if rep % 2 == 0 else ("fair", "plain"):
                run = one_run(server.url, mode == "fair", args.tasks)
                runs[mode].append(run)
                print(
                    f"rep {rep} {mode:5}: RSS {run.start_rss / MIB:6.1f} MiB after start-up, "
                    f"peak {run.peak_rss / MIB:6.1f} MiB (+{run.growth / MIB:.1f}), end "
                    f"{run.end_rss / MIB:6.1f} MiB; {run.drained} tasks at {run.rate:.0f}/s",
                    flush=True,
                )
    results: dict[str, Any] = {
        "env": environment(),
        "params": vars(args),
        "loadavg_before_after": [load_before, os.getloadavg()],
        "runs": {m: [asdict(r) for r in rs] for m, rs in runs.items()},
    }
    lines = [
        "# Bounded memory with a 100,000-task backlog (Redis)",
        "",
        f"Reproduce: `python -m bench.memory --tasks {args.tasks}` ({results['env']['when']}; "
        f"{args.tasks:,} no-op tasks over four queues, one `celery worker -P prefork -c 2`; "
        'celery-fair with weights 1:2:3:4, `fair_cost="runtime"` and Prometheus metrics on; '
        "RSS of the worker's main process from `/proc`).",
        "",
        "| worker | RSS after start-up | peak while draining | growth | at the end "
        "| tasks drained | tasks/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, rs in runs.items():
        for r in rs:
            lines.append(
                f"| {'plain Celery' if mode == 'plain' else 'celery-fair'} "
                f"| {r.start_rss / MIB:.1f} MiB | {r.peak_rss / MIB:.1f} MiB "
                f"| +{r.growth / MIB:.1f} MiB | {r.end_rss / MIB:.1f} MiB | {r.drained:,} "
                f"| {r.rate:.0f} |"
            )
    plain_growth = max(r.growth for r in runs["plain"])
    fair_growth = max(r.growth for r in runs["fair"])
    lines += [
        "",
        f"Growth while draining: plain Celery +{plain_growth / MIB:.1f} MiB, celery-fair "
        f"+{fair_growth / MIB:.1f} MiB. The backlog stays in Redis: a worker holds only its "
        "prefetch window, and celery-fair's state is per queue, not per queued task.",
        "",
        f"Load average before / after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores. The tasks/s column is only informative: the machine is "
        "shared, and memory, not speed, is measured here.",
    ]
    write("memory", results, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
