"""``make demo``: plain Celery against celery-fair, side by side, on a local Redis.

Starts its own ``redis-server`` on a free loopback port, fills ten queues
p0..p9 (quanta 4, 8, .., 40, the DWRR article's experiment), runs a real
``celery worker -P prefork -c 2`` on them twice, once plain and once with
celery-fair, shows live progress, and ends with the consumed counts side by
side.  Takes about a minute.
"""

from __future__ import annotations

import argparse
import sys
import time

from .testing.harness import RunResult, run_backlogged
from .testing.redis import RedisServer

QUANTA = {f"p{i}": 4 * (i + 1) for i in range(10)}


def _progress(label: str, target: int) -> object:
    last = [0.0]

    def show(consumed: dict[str, int], elapsed: float) -> None:
        now = time.monotonic()
        total = sum(consumed.values())
        if now - last[0] < 0.25 and total < target:
            return
        last[0] = now
        done = min(1.0, total / target)
        bar = "#" * int(done * 30) + "." * (30 - int(done * 30))
        rate = total / elapsed if elapsed > 0 else 0.0
        ratio = consumed["p9"] / consumed["p0"] if consumed["p0"] else float("nan")
        sys.stdout.write(
            f"\r  {label:12} [{bar}] {total:6}/{target} tasks  {rate:6.0f}/s  p9/p0 {ratio:5.2f}"
        )
        sys.stdout.flush()

    return show


def table(plain: RunResult, fair: RunResult) -> str:
    total_q = sum(QUANTA.values())
    rows = [
        f"{'Queue':6} {'Quantum':>7} | {'plain Celery':>12} {'share':>6} | "
        f"{'celery-fair':>11} {'share':>6} | {'target':>6}",
        "-" * 70,
    ]
    for q, quantum in QUANTA.items():
        rows.append(
            f"{q:6} {quantum:7} | {plain.consumed[q]:12} {plain.shares()[q]:6.1%} | "
            f"{fair.consumed[q]:11} {fair.shares()[q]:6.1%} | {quantum / total_q:6.1%}"
        )
    rows.append("-" * 70)
    pr = plain.consumed["p9"] / max(1, plain.consumed["p0"])
    fr = fair.consumed["p9"] / max(1, fair.consumed["p0"])
    rows.append(f"{'p9/p0':14} | {pr:19.2f} | {fr:18.2f} | {10:6.2f}")
    rows.append(f"{'tasks/s':14} | {plain.rate:19.0f} | {fair.rate:18.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="plain Celery vs celery-fair on a local Redis")
    parser.add_argument("--per-queue", type=int, default=2500)
    parser.add_argument("--target", type=int, default=8000)
    parser.add_argument("--task-us", type=int, default=100, help="task duration (0: no-op)")
    args = parser.parse_args(argv)
    weights = ",".join(f"{q}={w}" for q, w in QUANTA.items())
    print("celery-fair demo: 10 queues p0..p9, quanta 4..40, every queue backlogged,")
    print(f"celery worker -P prefork -c 2, {args.task_us} us tasks, {args.target} tasks measured.")
    with RedisServer() as redis:
        print(f"  started redis-server on 127.0.0.1:{redis.port}")
        results = {}
        for label, fair in (("plain Celery", False), ("celery-fair", True)):
            results[label] = run_backlogged(
                redis.url,
                dict.fromkeys(QUANTA, args.per_queue),
                target=args.target,
                warmup=200,
                fair=fair,
                args=(args.task_us,),
                extra_args=["--fair-weights", weights] if fair else [],
                on_sample=_progress(label, args.target),  # type: ignore[arg-type]
            )
            print()
    print()
    print(table(results["plain Celery"], results["celery-fair"]))
    print()
    print("Plain Celery polls its queues round-robin: every backlogged queue gets the same")
    print("share whatever its quantum.  celery-fair fetches in DWRR order, so shares follow")
    print("the quanta (target p9/p0 = 10).  Benchmarks with repetitions: see bench/.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
