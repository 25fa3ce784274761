"""Fairness keys: shares between backlogged keys of one queue, by count and by run time.

Two experiments on a real Redis and ``celery worker -P prefork -c 2``, each against
plain Celery (one FIFO queue) on the same messages, alternating, ``--reps`` times:

* **weights**: keys ``a``, ``b``, ``c`` weighted 1:2:4, each with a backlog that lasts
  as long as the others' at those weights (publish order interleaved); the share of
  tasks each key ran while all three were backlogged (ledger start times);
* **runtime**: ``slow`` (10 ms tasks) and ``fast`` (1 ms tasks), equal weights,
  ``fair_cost="runtime"``; the share of the worker's time (the pool's measured run
  time, from telemetry) each key got while both were backlogged.

    python -m bench.keys_shares [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

import celery_fair
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE = "keyed"
WEIGHTS = {"a": 1, "b": 2, "c": 4}


def _publish(url: str, keyed: bool, counts: dict[str, int], ms: float) -> None:
    if keyed:
        app = keyed_app(url, {QUEUE: "tenant_id"}, "keys-shares-producer")
    else:
        app = Celery("keys-shares-producer", broker=url, set_as_current=False)
        celery_fair.install(app)
    publish_by_key(app, QUEUE, counts, ms)
    app.close()


def _worker(url: str, keyed: bool, **env: str) -> WorkerProcess:
    extra = {"CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id"} if keyed else {}
    return WorkerProcess(
        url, [QUEUE], concurrency=2, fair=keyed, env={"CELERY_FAIR_LEDGER": url, **extra, **env}
    )


def weights_run(keyed: bool) -> dict[str, float]:
    """Task shares of a, b, c while all are backlogged."""
    with RedisServer() as server:
        _publish(server.url, keyed, {k: 300 * w for k, w in WEIGHTS.items()}, ms=2)
        ledger = Ledger(server.url)
        with _worker(server.url, keyed, CELERY_FAIR_KEY_WEIGHTS="a=1,b=2,c=4") as worker:
            assert ledger.wait_for(1700, timeout=300, alive=[worker]), worker.log()[-3000:]
        entries = sorted(ledger.entries(), key=lambda e: e.started)
    window = entries[100:1600]
    counts = Counter(e.tenant for e in window)
    return {k: counts[k] / len(window) for k in WEIGHTS}


def runtime_run(keyed: bool) -> dict[str, float]:
    """Shares of the worker's measured run time of slow and fast while both are backlogged."""
    import pyarrow.parquet as pq

    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        _publish(server.url, keyed, {"slow": 400}, ms=10)
        _publish(server.url, keyed, {"fast": 4000}, ms=1)
        telemetry = Path(tmp) / "telemetry"
        ledger = Ledger(server.url)
        env = {"CELERY_FAIR_COST": "runtime", "CELERY_FAIR_TELEMETRY_DIR": str(telemetry)}
        with _worker(server.url, True, **env) if keyed else _worker(server.url, False) as worker:
            assert ledger.wait_for(2000, timeout=300, alive=[worker]), worker.log()[-3000:]
        if keyed:
            rows = [
                (r["started"], r["fair_key"], r["runtime"])
                for r in pq.read_table(telemetry).to_pylist()
                if r["outcome"] == "success"
            ]
        else:  # plain Celery writes no telemetry: the ledger's own times
            rows = [(e.started, e.tenant, e.finished - e.started) for e in ledger.entries()]
    rows.sort()
    last = min(max(t for t, k, _ in rows if k == key) for key in ("slow", "fast"))
    busy: Counter[str] = Counter()
    for started, key, runtime in rows[100:]:
        if started < last:
            busy[key] += runtime
    total = busy["slow"] + busy["fast"]
    return {k: busy[k] / total for k in ("slow", "fast")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="keys_shares")
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        "weights": {"plain": [], "keyed": []},
        "runtime": {"plain": [], "keyed": []},
    }
    for rep in range(args.reps):
        order = ["plain", "keyed"] if rep % 2 == 0 else ["keyed", "plain"]
        for mode in order:
            w = weights_run(mode == "keyed")
            runs["weights"][mode].append(w)
            print(f"rep {rep + 1} weights {mode:5}: " + _fmt(w), flush=True)
        for mode in order:
            r = runtime_run(mode == "keyed")
            runs["runtime"][mode].append(r)
            print(f"rep {rep + 1} runtime {mode:5}: " + _fmt(r), flush=True)
    results: dict[str, Any] = {"env": environment(), "args": vars(args), "runs": runs}
    write(args.name, results, _markdown(results))
    return 0


def _fmt(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1%}" for k, v in shares.items())


def _cell(values: list[float]) -> str:
    s = summary(values)
    return f"{s['median']:.1%} [{s['min']:.1%}, {s['max']:.1%}]"


def _markdown(results: dict[str, Any]) -> str:
    runs, env, reps = results["runs"], results["env"], results["args"]["reps"]
    total = sum(WEIGHTS.values())
    lines = [
        "# Fairness keys: shares inside one queue",
        "",
        f"Reproduce: `python -m bench.keys_shares --reps {reps}` ({env['when']}, celery "
        f"{env['celery']}, kombu {env['kombu']}, {env['cpus']} CPUs). Medians over {reps} "
        "repetitions [min, max]; plain Celery (one FIFO queue, the same messages) and the "
        "keyed queue alternate. `celery worker -P prefork -c 2` on a real Redis.",
        "",
        "Weights 1:2:4, tasks of 2 ms, backlogs that last equally long at those weights; "
        "shares of the tasks run while all three keys were backlogged.",
        "",
        "| key | weight | target | plain Celery | keyed queue | error |",
        "|---|---|---|---|---|---|",
    ]
    for key, weight in WEIGHTS.items():
        keyed = [r[key] for r in runs["weights"]["keyed"]]
        target = weight / total
        error = max(abs(v - target) for v in keyed)
        lines.append(
            f"| {key} | {weight} | {target:.1%} | "
            f"{_cell([r[key] for r in runs['weights']['plain']])} | {_cell(keyed)} | "
            f"{error:.1%} (worst) |"
        )
    lines += [
        "",
        'Equal weights, `fair_cost="runtime"`: 10 ms against 1 ms tasks; shares of the '
        "worker's time (celery-fair: the pool's measured run time from telemetry; plain "
        "Celery: the ledger's start to finish) while both keys were backlogged.",
        "",
        "| key | task | target | plain Celery | keyed queue |",
        "|---|---|---|---|---|",
    ]
    for key, ms in (("slow", 10), ("fast", 1)):
        lines.append(
            f"| {key} | {ms} ms | 50.0% | {_cell([r[key] for r in runs['runtime']['plain']])} "
            f"| {_cell([r[key] for r in runs['runtime']['keyed']])} |"
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    sys.exit(main())
