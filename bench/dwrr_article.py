"""The DWRR article's experiment on a real Redis and real ``celery worker``s.

Ten queues p0..p9 with quanta 4, 8, .., 40 (message weight 4 is the same
ratio as weight 1 per message), every queue backlogged, ``-c 2``.  For each
pool and task (no-op, 100 us of CPU) it alternates plain Celery and
celery-fair, several repetitions each, and records per-queue consumption
(median over repetitions), p9/p0 and throughput (median and spread).

    python -m bench.dwrr_article [--broker redis|rabbitmq] [--workers 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from tests.harness.harness import run_backlogged
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUANTA = {f"p{i}": 4 * (i + 1) for i in range(10)}
WEIGHTS = ",".join(f"{q}={w}" for q, w in QUANTA.items())


def _server(broker: str) -> Any:
    if broker == "rabbitmq":
        from tests.harness.rabbitmq import RabbitMQServer

        return RabbitMQServer()
    return RedisServer()


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"env": environment(), "params": vars(args), "cases": {}}
    with _server(args.broker) as redis:
        for pool in args.pools:
            for us in args.task_us:
                case = f"{pool}/{'noop' if us == 0 else f'{us}us'}"
                runs: dict[str, list[dict[str, Any]]] = {"plain": [], "fair": []}
                for rep in range(args.reps):
                    order = ("plain", "fair") if rep % 2 == 0 else ("fair", "plain")
                    for mode in order:
                        res = run_backlogged(
                            redis.url,
                            dict.fromkeys(QUANTA, args.per_queue),
                            target=args.target,
                            warmup=300,
                            pool=pool,
                            concurrency=1 if pool == "solo" else args.concurrency,
                            workers=args.workers,
                            fair=mode == "fair",
                            args=(us,),
                            extra_args=["--fair-weights", WEIGHTS] if mode == "fair" else [],
                        )
                        runs[mode].append({"consumed": res.consumed, "rate": res.rate})
                        ratio = res.consumed["p9"] / max(1, res.consumed["p0"])
                        line = f"{case:16} rep {rep} {mode:5} {res.rate:7.0f} tasks/s"
                        print(f"{line}  p9/p0 {ratio:5.2f}", flush=True)
                results["cases"][case] = analyse(runs)
    return results


def analyse(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total_q = sum(QUANTA.values())
    for mode, reps in runs.items():
        consumed = {q: statistics.median(r["consumed"][q] for r in reps) for q in QUANTA}
        total = sum(consumed.values())
        shares = {q: consumed[q] / total for q in QUANTA}
        errors = {q: shares[q] / (QUANTA[q] / total_q) - 1 for q in QUANTA}
        ratios = [r["consumed"]["p9"] / max(1, r["consumed"]["p0"]) for r in reps]
        out[mode] = {
            "consumed": consumed,
            "shares": shares,
            "share_error": errors,
            "max_abs_share_error": max(abs(e) for e in errors.values()),
            "p9_over_p0": summary(ratios),
            "throughput": summary([r["rate"] for r in reps]),
            "runs": reps,
        }
    out["throughput_ratio"] = (
        out["fair"]["throughput"]["median"] / out["plain"]["throughput"]["median"]
    )
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# DWRR article experiment ({results['params']['broker']}, "
        f"{results['params']['workers']} worker process(es))",
        "",
        f"Reproduce: `python -m bench.dwrr_article --broker {results['params']['broker']} "
        f"--workers {results['params']['workers']}` ({results['env']['when']}, "
        f"celery {results['env']['celery']}, kombu {results['env']['kombu']}, "
        f"{results['params']['reps']} alternating repetitions, "
        f"{results['params']['target']} tasks measured per run).",
        "",
        "| case | mode | p9/p0 median [min, max] | worst share error | tasks/s median (spread) |",
        "|---|---|---|---|---|",
    ]
    for case, data in results["cases"].items():
        for mode in ("plain", "fair"):
            d = data[mode]
            r = d["p9_over_p0"]
            t = d["throughput"]
            lines.append(
                f"| {case} | {mode} | {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}] "
                f"| {d['max_abs_share_error']:+.1%} | {t['median']:.0f} ({t['spread']:.0%}) |"
            )
        lines.append(f"| {case} | fair/plain throughput | | | {data['throughput_ratio']:.1%} |")
    first = next(iter(results["cases"]))
    lines += [
        "",
        f"Per queue, {first} (median consumed over repetitions):",
        "",
        "| Queue | Quantum | Plain consumed | Plain rate | Fair consumed | Fair rate | Target |",
        "|---|---|---|---|---|---|---|",
    ]
    data = results["cases"][first]
    total_q = sum(QUANTA.values())
    for q, quantum in QUANTA.items():
        lines.append(
            f"| {q} | {quantum} | {data['plain']['consumed'][q]:.0f} "
            f"| {data['plain']['shares'][q]:.1%} | {data['fair']['consumed'][q]:.0f} "
            f"| {data['fair']['shares'][q]:.1%} | {quantum / total_q:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--per-queue", type=int, default=4000)
    parser.add_argument("--target", type=int, default=16000)
    parser.add_argument("--pools", nargs="+", default=["prefork", "threads", "solo"])
    parser.add_argument("--task-us", nargs="+", type=int, default=[100, 0])
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    if args.name is None:
        args.name = f"dwrr_article_{args.broker}" + (
            f"_{args.workers}w" if args.workers > 1 else ""
        )
    results = run(args)
    write(args.name, results, markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
