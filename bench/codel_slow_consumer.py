"""The slow-consumer scenario: one of two workers slows from 4 ms to 40 ms.

Two ``celery worker -P prefork -c 1`` processes take a steady stream of 4 ms
tasks.  Part way through, tasks on one worker slow to 40 ms (a per-worker
setting).  Plain Celery with prefetch 26 and 51 keeps the slow worker's
prefetched tasks waiting behind each other; celery-fair with CoDel returns
the stale ones to the broker, where the other worker takes them.  Latency is
publish -> start, from a ledger of task ids (which also proves nothing is lost).

    python -m bench.codel_slow_consumer [--broker redis|rabbitmq] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any

import redis as redis_lib

from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer

from .common import environment, summary, write

MODES = {
    "plain-26": {"fair": False, "multiplier": 26, "codel": None},
    "plain-51": {"fair": False, "multiplier": 51, "codel": None},
    "fair-codel-26": {"fair": True, "multiplier": 26, "codel": "0.02,0.2"},
    "fair-auto": {"fair": True, "multiplier": 26, "codel": None, "auto": True},
    "fair-codel-auto": {"fair": True, "multiplier": 26, "codel": "0.02,0.2", "auto": True},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def one_run(
    broker_url: str, ledger_url: str, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    spec = MODES[mode]
    load_before = os.getloadavg()[0]
    ledger = redis_lib.Redis.from_url(ledger_url)
    ledger.delete("ledger", "ledger:recorded")
    queue = f"stream-{uuid.uuid4().hex[:6]}"
    slow_from = time.time() + 1e9  # set once the workers are up
    common = {
        "CELERY_FAIR_LEDGER": ledger_url,
        "CELERY_FAIR_PREFETCH_MULTIPLIER": str(spec["multiplier"]),
    }
    if spec["codel"]:
        common["CELERY_FAIR_CODEL"] = spec["codel"]
    if spec.get("auto"):
        common["CELERY_FAIR_PREFETCH"] = "auto"
    os.environ["CELERY_FAIR"] = "1"  # the producer stamps the publish time
    os.environ["CELERY_FAIR_BROKER"] = broker_url
    from tests.harness.workload import app
    from tests.harness.workload import ledger as ledger_task

    app.conf.broker_url = broker_url
    fast = WorkerProcess(broker_url, [queue], concurrency=1, fair=spec["fair"], env=common)
    slow_env = dict(common, CELERY_FAIR_SLOW_MS="36")
    published: dict[str, float] = {}
    t0 = time.time()
    with app.producer_or_acquire() as producer:
        ledger_task.apply_async((4,), queue=queue, producer=producer)  # declares the queue
    with fast:
        slow_from = time.time() + 3 + args.steady
        slow_env["CELERY_FAIR_SLOW_FROM"] = str(slow_from)
        slow = WorkerProcess(broker_url, [queue], concurrency=1, fair=spec["fair"], env=slow_env)
        with slow:
            time.sleep(3)  # both workers up
            t0 = time.time()
            end = t0 + args.steady + args.slow
            n = 0
            with app.producer_or_acquire() as producer:
                while time.time() < end:
                    result = ledger_task.apply_async((4,), queue=queue, producer=producer)
                    published[result.id] = time.time()
                    n += 1
                    # A steady stream: the next publish at its slot.
                    delay = t0 + n / args.rate - time.time()
                    if delay > 0:
                        time.sleep(delay)
            deadline = time.time() + 120
            while (
                len({json.loads(x)["id"] for x in ledger.lrange("ledger", 0, -1)})
                < len(published) + 1
                and time.time() < deadline
            ):
                time.sleep(0.2)
    entries = [json.loads(x) for x in ledger.lrange("ledger", 0, -1)]
    ran: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        ran.setdefault(e["id"], []).append(e)
    missing = [tid for tid in published if tid not in ran]
    duplicates = sum(len(v) - 1 for tid, v in ran.items() if tid in published)
    phases: dict[str, list[float]] = {"steady": [], "slow": []}
    requeued = {"steady": 0, "slow": 0}
    for tid, pub in published.items():
        if tid not in ran:
            continue
        first = min(ran[tid], key=lambda e: e["started"])
        phase = "steady" if pub < slow_from else "slow"
        phases[phase].append(first["started"] - pub)
        requeued[phase] += any(e["requeues"] > 0 for e in ran[tid])
    out: dict[str, Any] = {"published": len(published), "missing": len(missing),
                           "duplicates": duplicates,
                           "load": [load_before, os.getloadavg()[0]]}  # fmt: skip
    for phase, lat in phases.items():
        out[phase] = {
            "n": len(lat),
            "p50": percentile(lat, 0.50),
            "p99": percentile(lat, 0.99),
            "max": max(lat) if lat else float("nan"),
            "requeued_fraction": requeued[phase] / max(1, len(lat)),
        }
    return out


def _server(broker: str) -> Any:
    if broker == "rabbitmq":
        from tests.harness.rabbitmq import RabbitMQServer

        return RabbitMQServer()
    return RedisServer()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rate", type=float, default=150.0, help="tasks published per second")
    parser.add_argument("--steady", type=float, default=6.0, help="seconds before the slowdown")
    parser.add_argument("--slow", type=float, default=12.0, help="seconds of slowdown")
    parser.add_argument(
        "--tag", default="", help="suffix of the result files (a run with other parameters)"
    )
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with RedisServer() as ledger_server, _server(args.broker) as broker:
        for rep in range(args.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                r = one_run(broker.url, ledger_server.url, mode, args)
                runs[mode].append(r)
                print(
                    f"rep {rep} {mode:14} slow p50 {r['slow']['p50'] * 1000:7.1f} ms  "
                    f"p99 {r['slow']['p99'] * 1000:7.1f} ms  max {r['slow']['max'] * 1000:7.1f} ms"
                    f"  steady requeued {r['steady']['requeued_fraction']:.2%}  "
                    f"missing {r['missing']}  dup {r['duplicates']}  "
                    f"load {r['load'][0]:.1f}-{r['load'][1]:.1f}",
                    flush=True,
                )
    results: dict[str, Any] = {"env": environment(), "params": vars(args), "modes": {}}
    for mode, reps in runs.items():
        results["modes"][mode] = {
            phase: {k: summary([r[phase][k] for r in reps])
                    for k in ("p50", "p99", "max", "requeued_fraction")}
            for phase in ("steady", "slow")
        }  # fmt: skip
        results["modes"][mode]["missing"] = sum(r["missing"] for r in reps)
        results["modes"][mode]["duplicates"] = sum(r["duplicates"] for r in reps)
        results["modes"][mode]["published"] = sum(r["published"] for r in reps)
        results["modes"][mode]["runs"] = reps
    base = results["modes"]["plain-26"]["slow"]["p99"]["median"]
    fair = results["modes"]["fair-codel-auto"]["slow"]["p99"]["median"]
    results["p99_cut_vs_plain_26"] = base / fair if fair else float("nan")
    auto = results["modes"]["fair-auto"]["slow"]["p99"]["median"]
    results["p99_cut_auto_only_vs_plain_26"] = base / auto if auto else float("nan")
    loads = [x for reps in runs.values() for r in reps for x in r["load"]]
    results["load_average"] = summary(loads)
    lines = [
        f"# Slow consumer ({args.broker})",
        "",
        f"Reproduce: `python -m bench.codel_slow_consumer --broker {args.broker}"
        + (f" --rate {args.rate:g} --tag {args.tag}" if args.tag else "")
        + "` "
        f"({results['env']['when']}; two `-P prefork -c 1` workers, {args.rate:.0f} tasks/s of "
        f"4 ms, one worker slows to 40 ms after {args.steady:.0f} s for {args.slow:.0f} s; "
        f"{args.reps} alternating repetitions, medians).",
        "",
        "| mode | slow phase p50 | p99 | max | slow requeued | steady p99 | steady requeued "
        "| lost | dup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, d in results["modes"].items():
        s, st = d["slow"], d["steady"]
        lines.append(
            f"| {mode} | {s['p50']['median'] * 1000:.0f} ms | {s['p99']['median'] * 1000:.0f} ms "
            f"| {s['max']['median'] * 1000:.0f} ms | {s['requeued_fraction']['median']:.2%} "
            f"| {st['p99']['median'] * 1000:.0f} ms "
            f"| {st['requeued_fraction']['median']:.2%} | {d['missing']} of {d['published']} "
            f"| {d['duplicates']} |"
        )
    load = results["load_average"]
    lines += [
        "",
        f'Slow-phase p99 with CoDel and `fair_prefetch="auto"`: cut by '
        f"{results['p99_cut_vs_plain_26']:.1f}x against plain prefetch 26 "
        f'(`fair_prefetch="auto"` alone: {results["p99_cut_auto_only_vs_plain_26"]:.1f}x).',
        "",
        "1-min load average at the start and end of each run (the benchmark's own two "
        f"workers and broker included; 2 cores): median {load['median']:.1f}, "
        f"range {load['min']:.1f}-{load['max']:.1f}.",
    ]
    suffix = f"_{args.tag}" if args.tag else ""
    write(f"codel_slow_consumer_{args.broker}{suffix}", results, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
