"""Resources (issue #53): Dominant Resource Fairness beside plain Celery, in turns.

On a real Redis with real ``celery worker`` processes (Celery's defaults
otherwise), celery-fair and plain Celery alternate ``--reps`` times in every
experiment; every queue or tenant is backlogged for the whole measurement (the
window runs from the first start to the first tenant's last start), and every
figure comes from the ledger of each run's start and finish.  Tasks declare
what one run holds per call (``apply_async(..., fair_resources={...})``);
plain Celery gets the same messages and ignores the declaration.

* **paper** (Ghodsi et al., NSDI 2011): one worker ``-P threads -c 10`` of
  capacity <9 CPUs, 18 GB>; queue ``a``'s tasks hold <1, 4>, ``b``'s <3, 1>;
  tasks sleep ``--task-ms``.  celery-fair: ``fair_capacity`` and
  ``fair_cost="dominant"``, equal weights.  Time-averaged running tasks of A
  and B and their ratio (DRF: 3:2 = 1.5, held to 10 %), the peak of each
  resource held at one instant, and the starts that found more than the
  capacity held.
* **two_workers**: workers of <9, 18> and <6, 24> (``-P threads -c 10`` each)
  on one keyed queue ``jobs`` (``fair_keys={"jobs": "tenant_id"}``), tenant
  ``A`` publishing the paper's <1, 4> tasks and ``B`` its <3, 1>.  Each
  tenant's dominant share of the two workers' sum (15 CPUs, 42 GB),
  time-averaged, and their ratio (DRF: equal, held to 5 %); each worker's peaks
  against its own capacity.  Plain Celery consumes an ordinary queue ``jobs``
  (a keyed queue's messages are kept per key, which plain Celery cannot read).
* **queue_concurrency**: one worker ``-P prefork -c 4``, either
  ``--autoscale 4,1`` or ``--max-tasks-per-child 10``; queues ``video``
  (``fair_queue_concurrency={"video": 2}``) and ``other``, both backlogged with
  ``--qc-tasks`` tasks each, ``other``'s of ``--qc-ms`` and ``video``'s of
  ``--qc-video-ms`` (longer, so that a worker fetching the two queues in turns
  fills most of its pool with video: with tasks of one length, plain Celery
  would hold about 2 of each anyway and the limit would bind nothing).  The
  most ``video`` tasks at once (at most 2), the time-averaged running of each
  queue (``other`` takes the rest of the worker), and that every task ran
  exactly once.
* **packing**: one worker ``-P threads -c 10`` of capacity <8 CPUs, 32 GB,
  2 GPUs>, four queues of four shapes.  Each resource's time-averaged use; the
  bottleneck (the resource DRF's own allocation uses most) against two
  references: *DRF's allocation* (:func:`~celery_fair.scheduling.resources.
  progressive_filling`, every queue backlogged, equal weights: what a fair
  worker is held to) and *the best mix* (an exhaustive search over integer
  counts of the four shapes within the capacity and the 10 threads: the most
  any admission could use of the bottleneck, fair or not).

    python -m bench.resources [--reps 3] [--only paper,two_workers,queue_concurrency,packing]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery

import celery_fair
from celery_fair.scheduling.resources import SLOTS, progressive_filling
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, most_at_once
from tests.harness.ledger import Entry, Ledger
from tests.harness.redis import RedisServer
from tests.harness.resources import (
    backlogged_window,
    declared,
    over_capacity,
    peaks,
    ran_once,
    running,
    shares,
)

from .common import environment, summary, write

Shape = Mapping[str, float]

CONCURRENCY = 10
PAPER_CAPACITY = {"cpu": 9.0, "mem": 18.0}
PAPER = {"a": {"cpu": 1.0, "mem": 4.0}, "b": {"cpu": 3.0, "mem": 1.0}}
#: DRF's time-averaged A:B in the paper's example, and the tolerance the bench checks.
PAPER_RATIO, PAPER_TOLERANCE = 1.5, 0.10
WORKER_CAPACITIES = ({"cpu": 9.0, "mem": 18.0}, {"cpu": 6.0, "mem": 24.0})
TENANTS = {"A": PAPER["a"], "B": PAPER["b"]}
KEYED = "jobs"
SHARES_TOLERANCE = 0.05
QC_CONCURRENCY, QC_LIMIT = 4, 2
QC_VARIANTS = {
    "autoscale": ["--autoscale", f"{QC_CONCURRENCY},1"],
    "max-tasks-per-child": ["--max-tasks-per-child", "10"],
}
PACKING_CAPACITY = {"cpu": 8.0, "mem": 32.0, "gpu": 2.0}
PACKING = {
    "small": {"cpu": 1.0, "mem": 2.0},
    "cpu": {"cpu": 4.0, "mem": 4.0},
    "mem": {"cpu": 1.0, "mem": 12.0},
    "gpu": {"cpu": 2.0, "mem": 4.0, "gpu": 1.0},
}
MODES = ("plain", "fair")


# -- the arithmetic (no broker; tested in bench/tests/test_resources_bench.py) ----------------


def as_setting(amounts: Mapping[str, float]) -> str:
    """``{"cpu": 9, "mem": 18}`` as the workload's environment spells it: ``cpu=9,mem=18``."""
    return ",".join(f"{name}={amount:g}" for name, amount in amounts.items())


def use_of(counts: Mapping[str, float], shapes: Mapping[str, Shape],
           capacity: Mapping[str, float]) -> dict[str, float]:  # fmt: skip
    """Each resource's use (fraction of ``capacity``) by ``counts`` tasks of each shape."""
    return {
        name: sum(counts.get(q, 0.0) * shapes[q].get(name, 0.0) for q in shapes) / amount
        for name, amount in capacity.items()
    }


def drf_allocation(shapes: Mapping[str, Shape], capacity: Mapping[str, float],
                   slots: int) -> dict[str, int]:  # fmt: skip
    """Tasks per queue that weighted DRF gives (equal weights), a slot being one more resource."""
    whole = {**capacity, SLOTS: float(slots)}
    return progressive_filling(whole, {q: {**s, SLOTS: 1.0} for q, s in shapes.items()})


def best_mix(
    shapes: Mapping[str, Shape], capacity: Mapping[str, float], slots: int, resource: str
) -> tuple[dict[str, int], float]:
    """The integer mix of ``shapes`` that uses the most of ``resource``, and that use.

    An exhaustive search over every count of every shape that fits ``capacity``
    and ``slots`` tasks at once (fairness ignored: the most any admission could
    use).  Ties go to the mix with fewer tasks, then to the first found.
    """
    names = list(shapes)
    best: tuple[dict[str, int], float] = (dict.fromkeys(names, 0), 0.0)

    def fits(held: Mapping[str, float], shape: Shape) -> bool:
        return all(held.get(r, 0.0) + a <= capacity.get(r, 0.0) + 1e-9 for r, a in shape.items())

    def search(i: int, counts: dict[str, int], held: dict[str, float], left: int) -> None:
        nonlocal best
        if i == len(names):
            use = held.get(resource, 0.0) / capacity[resource]
            fewer = sum(counts.values()) < sum(best[0].values())
            if use > best[1] + 1e-9 or (abs(use - best[1]) <= 1e-9 and fewer):
                best = (dict(counts), use)
            return
        shape = shapes[names[i]]
        n = 0
        while True:
            counts[names[i]] = n
            search(i + 1, counts, held, left - n)
            if n == left or not fits(held, shape):
                break
            for r, a in shape.items():
                held[r] = held.get(r, 0.0) + a
            n += 1
        for r, a in shape.items():
            held[r] = held.get(r, 0.0) - n * a
        counts[names[i]] = 0

    search(0, dict.fromkeys(names, 0), {}, slots)
    return best


def dominant_of(running_tasks: Mapping[str, float], demands: Mapping[str, Shape],
                capacity: Mapping[str, float]) -> dict[str, float]:  # fmt: skip
    """Each tenant's dominant share of ``capacity`` with ``running_tasks[t]`` tasks running."""
    return {
        t: max(running_tasks.get(t, 0.0) * d.get(r, 0.0) / c for r, c in capacity.items())
        for t, d in demands.items()
    }


def first_start(entries: Sequence[Entry], worker: str) -> float:
    """When the worker named ``worker`` (``name@host`` in the ledger) started its first task."""
    return min(e.started for e in entries if e.worker.startswith(worker + "@"))


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


# -- one run on a real Redis ------------------------------------------------------------------


def _publish(
    app: Celery,
    groups: Sequence[tuple[str, str, Shape | None, int]],
    ms: float | Mapping[str, float],
) -> None:
    """``n`` ``ledger(ms, tenant_id)`` tasks per (queue, tenant, shape, n), interleaved.

    The producer has celery-fair installed in both modes (it is the user's
    app; the declaration then travels in a header, which plain Celery's
    worker ignores).  Without it Celery would hand the unknown option to Kombu
    as a message property, which a plain worker ignores as well.
    """
    left = [n for *_, n in groups]
    with app.producer_or_acquire() as producer:
        while any(left):
            for i, (queue, tenant, shape, _) in enumerate(groups):
                if left[i]:
                    left[i] -= 1
                    options = {} if shape is None else {"fair_resources": dict(shape)}
                    sleep = ms[queue] if isinstance(ms, Mapping) else ms
                    app.signature("ledger", kwargs={"ms": sleep, "tenant_id": tenant}).apply_async(
                        queue=queue, producer=producer, **options
                    )


def one_run(
    groups: Sequence[tuple[str, str, Shape | None, int]],
    envs: Sequence[Mapping[str, str]],
    *,
    fair: bool,
    ms: float | Mapping[str, float],
    pool: str = "threads",
    concurrency: int = CONCURRENCY,
    extra_args: Sequence[str] = (),
    keys: Mapping[str, str] | None = None,
    timeout: float = 240.0,
) -> tuple[list[Entry], list[str]]:
    """Publish ``groups``, run one worker per environment in ``envs`` until all ran.

    ``ms``: what each task sleeps, or a mapping queue -> that.

    ``keys`` (celery-fair only): the producer's ``fair_keys``, also given to
    every worker.  Returns the ledger and the workers' names.
    """
    queues = list(dict.fromkeys(q for q, *_ in groups))
    with RedisServer() as server:
        if fair and keys:
            producer = keyed_app(server.url, keys, "resources-producer")
        else:
            producer = Celery("resources-producer", broker=server.url, set_as_current=False)
            celery_fair.install(producer)
        try:
            _publish(producer, groups, ms)
        finally:
            producer.close()
        ledger = Ledger(server.url)
        base = {"CELERY_FAIR_LEDGER": server.url}
        if fair and keys:
            base["CELERY_FAIR_KEYS"] = ",".join(f"{q}={spec}" for q, spec in keys.items())
        workers = [
            WorkerProcess(server.url, queues, pool=pool, concurrency=concurrency, fair=fair,
                          env={**base, **(env if fair else {})}, extra_args=extra_args)
            for env in envs
        ]  # fmt: skip
        try:
            for worker in workers:
                worker.start()
            if not ledger.wait_for(sum(n for *_, n in groups), timeout=timeout, alive=workers):
                raise RuntimeError("not every task ran:\n" + workers[0].log()[-3000:])
        finally:
            for worker in workers:
                worker.stop()
        return ledger.entries(), [w.name for w in workers]


def _fair_env(capacity: Mapping[str, float]) -> dict[str, str]:
    return {"CELERY_FAIR_CAPACITY": as_setting(capacity), "CELERY_FAIR_COST": "dominant"}


def paper_run(fair: bool, tasks: int, ms: float) -> dict[str, Any]:
    groups = [(q, q, shape, tasks) for q, shape in PAPER.items()]
    raw, _ = one_run(groups, [_fair_env(PAPER_CAPACITY)], fair=fair, ms=ms)
    entries = declared(raw, PAPER)
    start, end = backlogged_window(entries, PAPER)
    run = {q: running(entries, q, start, end) for q in PAPER}
    return {
        "running": run,
        "ratio": ratio(run["a"], run["b"]),
        "peak": peaks(entries),
        "over": over_capacity(entries, PAPER_CAPACITY),
        "starts": len(entries),
        "window_s": end - start,
        "declared_by_worker": sum(1 for e in raw if e.resources),
        **ran_once(entries, 2 * tasks),
    }


def two_workers_run(fair: bool, tasks: int, ms: float) -> dict[str, Any]:
    groups = [(KEYED, t, shape, tasks) for t, shape in TENANTS.items()]
    envs = [_fair_env(c) for c in WORKER_CAPACITIES]
    raw, names = one_run(groups, envs, fair=fair, ms=ms, keys={KEYED: "tenant_id"})
    entries = declared(raw, TENANTS)
    start, end = backlogged_window(entries, TENANTS)
    # From the moment both workers run: the first to start would otherwise count alone.
    start = max(start, *(first_start(entries, name) for name in names))
    total = {r: sum(c[r] for c in WORKER_CAPACITIES) for r in WORKER_CAPACITIES[0]}
    dominant = shares(entries, TENANTS, total, start, end)
    per_worker = []
    for name, capacity in zip(names, WORKER_CAPACITIES, strict=True):
        runs = [e for e in entries if e.worker.startswith(name + "@")]
        per_worker.append({"capacity": capacity, "runs": len(runs), "peak": peaks(runs),
                           "over": over_capacity(runs, capacity)})  # fmt: skip
    return {
        "running": {t: running(entries, t, start, end) for t in TENANTS},
        "dominant": dominant,
        "ratio": ratio(dominant["A"], dominant["B"]),
        "workers": per_worker,
        "window_s": end - start,
        **ran_once(entries, 2 * tasks),
    }


def queue_concurrency_run(
    fair: bool, variant: str, tasks: int, ms: float, video_ms: float
) -> dict[str, Any]:
    groups = [("video", "video", None, tasks), ("other", "other", None, tasks)]
    env = {"CELERY_FAIR_QUEUE_CONCURRENCY": f"video={QC_LIMIT}"}
    entries, _ = one_run(
        groups, [env], fair=fair, ms={"video": video_ms, "other": ms}, pool="prefork",
        concurrency=QC_CONCURRENCY, extra_args=QC_VARIANTS[variant],
    )  # fmt: skip
    start, end = backlogged_window(entries, ["video", "other"])
    run = {q: running(entries, q, start, end) for q in ("video", "other")}
    return {
        "most": most_at_once(entries),
        "running": run,
        "busy": sum(run.values()),
        "window_s": end - start,
        **ran_once(entries, 2 * tasks),
    }


def packing_run(fair: bool, tasks: int, ms: float, bottleneck: str) -> dict[str, Any]:
    groups = [(q, q, shape, tasks) for q, shape in PACKING.items()]
    raw, _ = one_run(groups, [_fair_env(PACKING_CAPACITY)], fair=fair, ms=ms)
    entries = declared(raw, PACKING)
    start, end = backlogged_window(entries, PACKING)
    run = {q: running(entries, q, start, end) for q in PACKING}
    use = use_of(run, PACKING, PACKING_CAPACITY)
    return {
        "running": run,
        "use": use,
        "bottleneck_use": use[bottleneck],
        "peak": peaks(entries),
        "over": over_capacity(entries, PACKING_CAPACITY),
        "starts": len(entries),
        "window_s": end - start,
        **ran_once(entries, len(PACKING) * tasks),
    }


# -- the experiments, in turns -----------------------------------------------------------------


def _in_turns(reps: int, label: str, run: Any) -> dict[str, list[dict[str, Any]]]:
    """``run(fair)`` for both modes, ``reps`` times, the order alternating."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            result = run(mode == "fair")
            runs[mode].append(result)
            brief = {k: v for k, v in result.items() if k not in ("workers",)}
            print(f"{label} rep {rep + 1} {mode}: {brief}", flush=True)
    return runs


def paper(args: argparse.Namespace) -> dict[str, Any]:
    runs = _in_turns(args.reps, "paper", lambda fair: paper_run(fair, args.tasks, args.task_ms))
    return {
        mode: {
            "ratio": summary([r["ratio"] for r in rs]),
            "running_a": summary([r["running"]["a"] for r in rs]),
            "running_b": summary([r["running"]["b"] for r in rs]),
            "within": all(abs(r["ratio"] / PAPER_RATIO - 1) <= PAPER_TOLERANCE for r in rs),
            "peak_cpu": max(r["peak"].get("cpu", 0.0) for r in rs),
            "peak_mem": max(r["peak"].get("mem", 0.0) for r in rs),
            "over": [f"{r['over']}/{r['starts']}" for r in rs],
            "runs": rs,
        }
        for mode, rs in runs.items()
    }


def two_workers(args: argparse.Namespace) -> dict[str, Any]:
    runs = _in_turns(args.reps, "two_workers",
                     lambda fair: two_workers_run(fair, args.tw_tasks, args.task_ms))  # fmt: skip
    return {
        mode: {
            "ratio": summary([r["ratio"] for r in rs]),
            "dominant_a": summary([r["dominant"]["A"] for r in rs]),
            "dominant_b": summary([r["dominant"]["B"] for r in rs]),
            "within": all(abs(r["ratio"] - 1) <= SHARES_TOLERANCE for r in rs),
            "over": [[w["over"] for w in r["workers"]] for r in rs],
            "runs": rs,
        }
        for mode, rs in runs.items()
    }


def queue_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in QC_VARIANTS:
        runs = _in_turns(
            args.reps, f"queue_concurrency {variant}",
            lambda fair, v=variant: queue_concurrency_run(
                fair, v, args.qc_tasks, args.qc_ms, args.qc_video_ms
            ),
        )  # fmt: skip
        out[variant] = {
            mode: {
                "most_video": max(r["most"].get("video", 0) for r in rs),
                "running_video": summary([r["running"]["video"] for r in rs]),
                "running_other": summary([r["running"]["other"] for r in rs]),
                "busy": summary([r["busy"] for r in rs]),
                "all_once": all(not r["missing"] and not r["repeats"] for r in rs),
                "runs": rs,
            }
            for mode, rs in runs.items()
        }
    return out


def packing(args: argparse.Namespace) -> dict[str, Any]:
    drf = drf_allocation(PACKING, PACKING_CAPACITY, CONCURRENCY)
    drf_use = use_of(drf, PACKING, PACKING_CAPACITY)
    bottleneck = max(drf_use, key=lambda name: drf_use[name])
    best, best_use = best_mix(PACKING, PACKING_CAPACITY, CONCURRENCY, bottleneck)
    runs = _in_turns(
        args.reps, "packing",
        lambda fair: packing_run(fair, args.packing_tasks, args.task_ms, bottleneck),
    )  # fmt: skip
    return {
        "drf_counts": drf,
        "drf_use": drf_use,
        "bottleneck": bottleneck,
        "best_counts": best,
        "best_use": best_use,
        **{
            mode: {
                "use": summary([r["bottleneck_use"] for r in rs]),
                "of_drf": summary([r["bottleneck_use"] / drf_use[bottleneck] for r in rs]),
                "of_best": summary([r["bottleneck_use"] / best_use for r in rs]),
                "peak": {n: max(r["peak"].get(n, 0.0) for r in rs) for n in PACKING_CAPACITY},
                "running": {q: summary([r["running"][q] for r in rs]) for q in PACKING},
                "over": [f"{r['over']}/{r['starts']}" for r in rs],
                "runs": rs,
            }
            for mode, rs in runs.items()
        },
    }


EXPERIMENTS = {
    "paper": paper,
    "two_workers": two_workers,
    "queue_concurrency": queue_concurrency,
    "packing": packing,
}


# -- the summary -------------------------------------------------------------------------------


def _num(d: Mapping[str, float], spec: str = ".3f") -> str:
    return f"{d['median']:{spec}} [{d['min']:{spec}}, {d['max']:{spec}}]"


def markdown(results: dict[str, Any]) -> str:
    args, env = results["args"], results["env"]
    lines = [
        "# Resources: Dominant Resource Fairness beside plain Celery",
        "",
        f"Reproduce: `python -m bench.resources --reps {args['reps']} --tasks {args['tasks']} "
        f"--tw-tasks {args['tw_tasks']} --task-ms {args['task_ms']:g} "
        f"--qc-tasks {args['qc_tasks']} --qc-ms {args['qc_ms']:g} "
        f"--qc-video-ms {args['qc_video_ms']:g} "
        f"--packing-tasks {args['packing_tasks']} --only {args['only']}` ({env['when']}, "
        f"celery {env['celery']}, kombu {env['kombu']}, {env['cpus']} CPUs). celery-fair and "
        f"plain Celery in turns; medians over {args['reps']} runs [min, max]; every queue "
        "backlogged over the window (first start to the first queue's last start).",
        "",
    ]
    if "paper" in results:
        p = results["paper"]
        lines += [
            f"## The paper's example: one worker `-P threads -c {CONCURRENCY}` of <9 CPUs, "
            "18 GB>, A <1, 4>, B <3, 1>",
            "",
            f"DRF runs three of A's and two of B's: A:B = {PAPER_RATIO:g} (held to "
            f"{PAPER_TOLERANCE:.0%}).",
            "",
            "| worker | A running | B running | A:B | within 10 % | peak CPUs | peak GB | "
            "starts over capacity |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mode in MODES:
            row = p[mode]
            lines.append(
                f"| {mode} | {_num(row['running_a'], '.2f')} | {_num(row['running_b'], '.2f')} | "
                f"{_num(row['ratio'])} | {'yes' if row['within'] else 'no'} | "
                f"{row['peak_cpu']:g} | {row['peak_mem']:g} | {', '.join(row['over'])} |"
            )
        lines.append("")
    if "two_workers" in results:
        t = results["two_workers"]
        lines += [
            "## Two workers of different sizes, one keyed queue",
            "",
            f"Workers <9, 18> and <6, 24> (`-P threads -c {CONCURRENCY}` each), tenant A <1, 4>, "
            "B <3, 1>; dominant shares of the sum <15, 42>, time-averaged (DRF: equal, held "
            f"to {SHARES_TOLERANCE:.0%}). Plain Celery consumes an ordinary queue.",
            "",
            "| worker | A's dominant share | B's | A / B | within 5 % | starts over its own "
            "worker's capacity (first + second worker, per run) |",
            "|---|---|---|---|---|---|",
        ]
        for mode in MODES:
            row = t[mode]
            lines.append(
                f"| {mode} | {_num(row['dominant_a'])} | {_num(row['dominant_b'])} | "
                f"{_num(row['ratio'])} | {'yes' if row['within'] else 'no'} | "
                f"{'; '.join(' + '.join(map(str, o)) for o in row['over'])} |"
            )
        lines.append("")
    if "queue_concurrency" in results:
        q = results["queue_concurrency"]
        lines += [
            f"## Queue concurrency: `video` limited to {QC_LIMIT} on one worker "
            f"`-P prefork -c {QC_CONCURRENCY}`",
            "",
            f"{args['qc_tasks']} tasks in each of `video` ({args['qc_video_ms']:g} ms) and "
            f"`other` ({args['qc_ms']:g} ms).",
            "",
            "| pool | worker | most video at once | video running | other running | "
            "all running | every task once |",
            "|---|---|---|---|---|---|---|",
        ]
        for variant, by_mode in q.items():
            for mode in MODES:
                row = by_mode[mode]
                lines.append(
                    f"| {' '.join(QC_VARIANTS[variant])} | {mode} | {row['most_video']} | "
                    f"{_num(row['running_video'], '.2f')} | {_num(row['running_other'], '.2f')} | "
                    f"{_num(row['busy'], '.2f')} | {'yes' if row['all_once'] else 'NO'} |"
                )
        lines.append("")
    if "packing" in results:
        k = results["packing"]
        b = k["bottleneck"]
        lines += [
            f"## Packing four shapes on one worker `-P threads -c {CONCURRENCY}` of <8 CPUs, "
            "32 GB, 2 GPUs>",
            "",
            "Shapes: " + ", ".join(f"`{q}` {as_setting(s)}" for q, s in PACKING.items()) + ".",
            f"DRF's allocation {k['drf_counts']} uses "
            + ", ".join(f"{n} {u:.2f}" for n, u in k["drf_use"].items())
            + f"; the bottleneck is **{b}**. The best mix for {b} (exhaustive search) is "
            f"{k['best_counts']}, using {k['best_use']:.2f}.",
            "",
            f"| worker | {b} used | of DRF's | of the best mix | running "
            + " / ".join(PACKING)
            + " (DRF: "
            + " / ".join(str(k["drf_counts"][q]) for q in PACKING)
            + ") | peak "
            + " / ".join(PACKING_CAPACITY)
            + " | starts over capacity |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in MODES:
            row = k[mode]
            lines.append(
                f"| {mode} | {_num(row['use'])} | {_num(row['of_drf'])} | {_num(row['of_best'])} | "
                + " / ".join(f"{row['running'][q]['median']:.2f}" for q in PACKING)
                + " | "
                + " / ".join(f"{row['peak'][n]:g}" for n in PACKING_CAPACITY)
                + f" | {', '.join(row['over'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=150,
                        help="tasks per queue (paper)")  # fmt: skip
    parser.add_argument("--tw-tasks", type=int, default=300, help="tasks per tenant (two_workers)")
    parser.add_argument("--task-ms", type=float, default=400.0)
    parser.add_argument("--qc-tasks", type=int, default=300, help="tasks per queue")
    parser.add_argument("--qc-ms", type=float, default=50.0, help="other's tasks")
    parser.add_argument("--qc-video-ms", type=float, default=200.0, help="video's tasks")
    parser.add_argument("--packing-tasks", type=int, default=60, help="tasks per queue")
    parser.add_argument("--only", default=",".join(EXPERIMENTS))
    parser.add_argument("--name", default="resources")
    args = parser.parse_args(argv)
    wanted = args.only.split(",")
    unknown = set(wanted) - set(EXPERIMENTS)
    if unknown:
        parser.error(f"unknown experiment(s): {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {"env": environment(), "args": vars(args)}
    for name in wanted:
        results[name] = EXPERIMENTS[name](args)
    write(args.name, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
