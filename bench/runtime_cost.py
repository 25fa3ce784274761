"""Runtime-cost mode on a real worker: two queues 1:1, 10 ms and 1 ms tasks.

With ``fair_cost="runtime"`` the worker's measured run time splits 50/50 and
the short queue completes about ten times as many tasks; with ``"count"``
the counts are 1:1.  Several repetitions, median and spread.

    python -m bench.runtime_cost [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import redis as redis_lib

from celery_fair.testing.harness import WorkerProcess, fill_queues
from celery_fair.testing.redis import RedisServer

from .common import environment, summary, write

TASK_US = {"long": 10_000, "short": 1_000}


def one_run(url: str, cost: str, measure: int, pool: str) -> dict[str, Any]:
    from celery_fair.testing.workload import app

    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    initial = {"long": measure, "short": 4 * measure}
    fill_queues(url, initial, args={q: (us,) for q, us in TASK_US.items()})
    app.conf.broker_url = url
    with WorkerProcess(url, list(TASK_US), pool=pool, env={"CELERY_FAIR_COST": cost}) as worker:
        deadline = time.monotonic() + 300
        while sum(initial[q] - client.llen(q) for q in initial) < measure:
            if time.monotonic() > deadline or worker.proc is None or worker.proc.poll():
                raise RuntimeError(worker.log()[-3000:])
            time.sleep(0.05)
        replies = app.control.inspect(timeout=3, limit=1)._request("fair_stats") or {}
    stats = next(iter(replies.values()))
    queues = stats["drr"]["queues"]
    served = {q: queues[q]["served_cost"] for q in TASK_US}
    fetched = stats["fetched"]
    client.flushdb()
    return {
        "measured_time_share_long": served["long"] / sum(served.values()),
        "count_ratio_short_over_long": fetched["short"] / max(1, fetched["long"]),
        "served_cost": served,
        "fetched": fetched,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--measure", type=int, default=2000)
    parser.add_argument("--pool", default="prefork")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"env": environment(), "params": vars(args), "modes": {}}
    with RedisServer() as server:
        runs: dict[str, list[dict[str, Any]]] = {"count": [], "runtime": []}
        for rep in range(args.reps):
            for cost in ("count", "runtime") if rep % 2 == 0 else ("runtime", "count"):
                r = one_run(server.url, cost, args.measure, args.pool)
                runs[cost].append(r)
                print(
                    f"rep {rep} {cost:7} time share long {r['measured_time_share_long']:.3f} "
                    f"short/long count {r['count_ratio_short_over_long']:.2f}",
                    flush=True,
                )
    for cost, reps in runs.items():
        results["modes"][cost] = {
            "time_share_long": summary([r["measured_time_share_long"] for r in reps]),
            "count_ratio": summary([r["count_ratio_short_over_long"] for r in reps]),
            "runs": reps,
        }
    lines = [
        "# Runtime-cost mode (Redis, real worker)",
        "",
        f"Reproduce: `python -m bench.runtime_cost` ({results['env']['when']}, "
        f"-P {args.pool} -c 2, queues `long` (10 ms) and `short` (1 ms), weights 1:1, "
        f"{args.reps} repetitions). Worker time is the run time the worker measured per queue.",
        "",
        "| fair_cost | worker time share of `long`, median [min, max] | short/long tasks |",
        "|---|---|---|",
    ]
    for cost in ("count", "runtime"):
        t = results["modes"][cost]["time_share_long"]
        c = results["modes"][cost]["count_ratio"]
        lines.append(
            f"| {cost} | {t['median']:.1%} [{t['min']:.1%}, {t['max']:.1%}] | {c['median']:.2f} |"
        )
    write("runtime_cost", results, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
