"""Resources: the DRF paper's example beside plain Celery, and packing four task shapes.

On a real Redis with a real ``celery worker -P threads -c 10`` (Celery's
defaults otherwise), every queue backlogged for the whole measurement (the
window ends at the first queue's last start):

* **paper** (Ghodsi et al., NSDI 2011): capacity <9 CPUs, 18 GB>; queue ``a``'s
  tasks hold <1, 4>, ``b``'s <3, 1>; tasks sleep ``--task-ms``.  celery-fair
  (``fair_capacity``, ``fair_cost="dominant"``) and plain Celery alternate,
  ``--reps`` each: time-averaged A:B (DRF: 1.5), the peak held of each
  resource, and the starts that found more than the capacity held.
* **packing**: capacity <8 CPUs, 32 GB, 2 GPUs>, four queues of four shapes.
  The bottleneck resource's time-averaged use against the use of weighted
  DRF's own allocation (:func:`~celery_fair.scheduling.resources.progressive_filling`
  with every queue backlogged): the ideal the worker's admission is held to.

    python -m bench.resources [--reps 3] [--tasks 150] [--task-ms 300] [--only paper,packing]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from celery import Celery

import celery_fair
from celery_fair.scheduling.resources import SLOTS, progressive_filling
from tests.harness.harness import WorkerProcess
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer
from tests.harness.resources import backlogged_window, over_capacity, peaks, running

from .common import environment, summary, write

CONCURRENCY = 10
PAPER_CAPACITY = {"cpu": 9.0, "mem": 18.0}
PAPER = {"a": {"cpu": 1.0, "mem": 4.0}, "b": {"cpu": 3.0, "mem": 1.0}}
PACKING_CAPACITY = {"cpu": 8.0, "mem": 32.0, "gpu": 2.0}
PACKING = {
    "small": {"cpu": 1.0, "mem": 2.0},
    "cpu": {"cpu": 4.0, "mem": 4.0},
    "mem": {"cpu": 1.0, "mem": 12.0},
    "gpu": {"cpu": 2.0, "mem": 4.0, "gpu": 1.0},
}


def _as_setting(capacity: Mapping[str, float]) -> str:
    return ",".join(f"{name}={amount:g}" for name, amount in capacity.items())


def one_run(
    shapes: Mapping[str, Mapping[str, float]],
    capacity: Mapping[str, float],
    *,
    fair: bool,
    tasks: int,
    ms: float,
) -> dict[str, Any]:
    """One worker over backlogged queues of ``shapes``: running tasks per queue, peaks."""
    queues = list(shapes)
    with RedisServer() as server:
        producer = Celery("resources-bench", broker=server.url)
        celery_fair.install(producer)
        for _ in range(tasks):
            for queue, shape in shapes.items():
                producer.send_task(
                    "ledger", kwargs={"ms": ms, "tenant_id": queue}, queue=queue,
                    fair_resources=dict(shape),
                )  # fmt: skip
        producer.close()
        env = {"CELERY_FAIR_LEDGER": server.url}
        if fair:
            env |= {"CELERY_FAIR_CAPACITY": _as_setting(capacity), "CELERY_FAIR_COST": "dominant"}
        ledger = Ledger(server.url)
        with WorkerProcess(
            server.url, queues, pool="threads", concurrency=CONCURRENCY, env=env, fair=fair
        ) as worker:
            if not ledger.wait_for(tasks * len(shapes), timeout=600, alive=[worker]):
                raise RuntimeError("not every task ran:\n" + worker.log()[-3000:])
        entries = ledger.entries()
    start, end = backlogged_window(entries, queues)
    return {
        "running": {q: running(entries, q, start, end) for q in queues},
        "peak": peaks(entries),
        "over": over_capacity(entries, capacity),
        "starts": len(entries),
        "window_s": end - start,
    }


def use_of(counts: Mapping[str, float], shapes: Mapping[str, Mapping[str, float]],
           capacity: Mapping[str, float]) -> dict[str, float]:  # fmt: skip
    """Each resource's use (fraction of ``capacity``) by ``counts`` tasks of each shape."""
    return {
        name: sum(counts[q] * shapes[q].get(name, 0.0) for q in shapes) / amount
        for name, amount in capacity.items()
    }


def paper(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "fair": []}
    for rep in range(args.reps):
        order = ("fair", "plain") if rep % 2 else ("plain", "fair")
        for mode in order:
            run = one_run(PAPER, PAPER_CAPACITY, fair=mode == "fair", tasks=args.tasks,
                          ms=args.task_ms)  # fmt: skip
            runs[mode].append(run)
            print(f"paper rep {rep} {mode}: A:B {run['running']['a'] / run['running']['b']:.3f} "
                  f"peak {run['peak']} over {run['over']}/{run['starts']}", flush=True)  # fmt: skip
    return {
        mode: {
            "ratio": summary([r["running"]["a"] / r["running"]["b"] for r in rs]),
            "peak_cpu": max(r["peak"].get("cpu", 0.0) for r in rs),
            "peak_mem": max(r["peak"].get("mem", 0.0) for r in rs),
            "over": [f"{r['over']}/{r['starts']}" for r in rs],
            "runs": rs,
        }
        for mode, rs in runs.items()
    }


def packing(args: argparse.Namespace) -> dict[str, Any]:
    whole = {**PACKING_CAPACITY, SLOTS: float(CONCURRENCY)}
    demands = {q: {**shape, SLOTS: 1.0} for q, shape in PACKING.items()}
    ideal_counts = progressive_filling(whole, demands)
    ideal = use_of(ideal_counts, PACKING, PACKING_CAPACITY)
    bottleneck = max(ideal, key=lambda name: ideal[name])
    runs = []
    for rep in range(args.reps):
        run = one_run(PACKING, PACKING_CAPACITY, fair=True, tasks=args.tasks, ms=args.task_ms)
        use = use_of(run["running"], PACKING, PACKING_CAPACITY)
        run["use"] = use
        run["of_ideal"] = use[bottleneck] / ideal[bottleneck]
        runs.append(run)
        print(f"packing rep {rep}: {bottleneck} {use[bottleneck]:.3f} of ideal "
              f"{ideal[bottleneck]:.3f} ({run['of_ideal']:.1%}); over {run['over']}",
              flush=True)  # fmt: skip
    return {
        "ideal_counts": ideal_counts,
        "ideal_use": ideal,
        "bottleneck": bottleneck,
        "of_ideal": summary([r["of_ideal"] for r in runs]),
        "runs": runs,
    }


def markdown(results: dict[str, Any]) -> str:
    args = results["args"]
    lines = [
        "# Resources: the DRF paper's example and packing",
        "",
        f"Reproduce: `python -m bench.resources --reps {args['reps']} --tasks {args['tasks']} "
        f"--task-ms {args['task_ms']:g} --only {args['only']}` ({results['env']['when']}, "
        f"celery {results['env']['celery']}; `celery worker -P threads -c {CONCURRENCY}`).",
        "",
    ]
    if "paper" in results:
        lines += [
            "## The paper's example: <9 CPUs, 18 GB>, A <1, 4>, B <3, 1> (DRF: A:B 1.5)",
            "",
            "| worker | A:B time-averaged, median [min, max] | peak CPUs | peak GB | "
            "starts over capacity |",
            "|---|---|---|---|---|",
        ]
        for mode, row in results["paper"].items():
            ratio = row["ratio"]
            lines.append(
                f"| {mode} | {ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}] | "
                f"{row['peak_cpu']:g} | {row['peak_mem']:g} | {', '.join(row['over'])} |"
            )
        lines.append("")
    if "packing" in results:
        pack = results["packing"]
        use = pack["of_ideal"]
        lines += [
            "## Packing four shapes on <8 CPUs, 32 GB, 2 GPUs>",
            "",
            f"DRF's allocation: {pack['ideal_counts']}; its use: "
            + ", ".join(f"{n} {u:.2f}" for n, u in pack["ideal_use"].items())
            + f". Bottleneck: {pack['bottleneck']}.",
            "",
            f"Measured use of the bottleneck against DRF's, median "
            f"{use['median']:.1%} [{use['min']:.1%}, {use['max']:.1%}] over "
            f"{len(pack['runs'])} runs; starts over capacity: "
            + ", ".join(str(r["over"]) for r in pack["runs"])
            + ".",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=150, help="tasks per queue")
    parser.add_argument("--task-ms", type=float, default=300.0)
    parser.add_argument("--only", default="paper,packing")
    parser.add_argument("--name", default="resources")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"env": environment(), "args": vars(args)}
    wanted = set(args.only.split(","))
    if "paper" in wanted:
        results["paper"] = paper(args)
    if "packing" in wanted:
        results["packing"] = packing(args)
    write(args.name, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
