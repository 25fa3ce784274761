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

from tests.harness.harness import WorkerProcess, fill_queues
from tests.harness.redis import RedisServer

from .common import environment, summary, write

TASK_US = {"long": 10_000, "short": 1_000}


def one_run(url: str, cost: str, measure: int, pool: str) -> dict[str, Any]:
    from tests.harness.control import control_app

    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    initial = {"long": measure, "short": 4 * measure}
    fill_queues(url, initial, args={q: (us,) for q, us in TASK_US.items()})
    app = control_app(url)
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
    nominal = {q: fetched[q] * TASK_US[q] for q in TASK_US}
    return {
        # The scheduler's served cost: measured run time in runtime mode, a
        # message count in count mode.
        "measured_time_share_long": served["long"] / sum(served.values()),
        "nominal_time_share_long": nominal["long"] / sum(nominal.values()),
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
    results["modes"] = analyse(runs)
    write("runtime_cost", results, markdown(results, args))
    print(markdown(results, args))
    return 0


def analyse(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cost, reps in runs.items():
        for r in reps:
            f = r["fetched"]
            r.setdefault(
                "nominal_time_share_long",
                f["long"]
                * TASK_US["long"]
                / (f["long"] * TASK_US["long"] + f["short"] * TASK_US["short"]),
            )
        out[cost] = {
            "nominal_time_share_long": summary([r["nominal_time_share_long"] for r in reps]),
            "time_share_long": summary([r["measured_time_share_long"] for r in reps]),
            "count_ratio": summary([r["count_ratio_short_over_long"] for r in reps]),
            "runs": reps,
        }
    return out


def markdown(results: dict[str, Any], args: Any) -> str:
    lines = [
        "# Runtime-cost mode (Redis, real worker)",
        "",
        f"Reproduce: `python -m bench.runtime_cost` ({results['env']['when']}, "
        f"-P {args.pool} -c 2, queues `long` (10 ms) and `short` (1 ms), weights 1:1, "
        f"{args.reps} repetitions). Measured: the run time the worker charged per queue "
        "(runtime mode); nominal: task counts times 10 ms and 1 ms.",
        "",
        "| fair_cost | time share of `long`: measured | nominal | short/long tasks |",
        "|---|---|---|---|",
    ]
    for cost in ("count", "runtime"):
        d = results["modes"][cost]
        n, c, m = d["nominal_time_share_long"], d["count_ratio"], d["time_share_long"]
        shown = (
            f"{m['median']:.1%} [{m['min']:.1%}, {m['max']:.1%}]"
            if cost == "runtime"
            else "not measured (count mode charges 1 per task)"
        )
        lines.append(
            f"| {cost} | {shown} | {n['median']:.1%} [{n['min']:.1%}, {n['max']:.1%}] "
            f"| {c['median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
