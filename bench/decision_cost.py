"""Cost of one DRR decision with 10, 100 and 10,000 backlogged queues.

The core's decision (``head`` + ``served``) must not grow with the number of
queues.  Also timed: the full fetch order a polling transport needs (its
length is the number of queues, so it is O(n) by nature, like Kombu's own
round-robin cycle), reported for comparison.

    python -m bench.decision_cost
"""

from __future__ import annotations

import sys
import timeit
from typing import Any

from celery_fair.scheduling.drr import DeficitRoundRobin
from celery_fair.scheduling.scheduler import FairScheduler

from .common import environment, summary, write

SIZES = (10, 100, 10_000)


def per_decision(n: int, reps: int = 7, decisions: int = 50_000) -> list[float]:
    drr = DeficitRoundRobin({f"q{i}": 1 + i % 4 for i in range(n)})
    for i in range(n):
        drr.activate(f"q{i}")
    step = drr.next
    return [t / decisions for t in timeit.repeat(step, number=decisions, repeat=reps)]


def per_fetch_order(n: int, reps: int = 5) -> list[float]:
    s = FairScheduler({f"q{i}": 1 + i % 4 for i in range(n)})
    s.set_queues(f"q{i}" for i in range(n))
    number = max(10, 200_000 // n)

    def fetch() -> None:
        q = s.fetch_order(8)[0]
        s.fetched(q)
        s.released(q)

    return [t / number for t in timeit.repeat(fetch, number=number, repeat=reps)]


def main() -> int:
    results: dict[str, Any] = {"env": environment(), "decision": {}, "fetch_order": {}}
    for n in SIZES:
        results["decision"][n] = summary(per_decision(n))
        results["fetch_order"][n] = summary(per_fetch_order(n))
        d = results["decision"][n]["median"] * 1e9
        f = results["fetch_order"][n]["median"] * 1e6
        print(f"{n:>6} queues: decision {d:7.0f} ns, full fetch order {f:9.1f} us", flush=True)
    lines = [
        "# DRR decision cost",
        "",
        f"Reproduce: `python -m bench.decision_cost` ({results['env']['when']}).",
        "",
        "| queues | decision (head + served), median ns [min, max] | full poll order, median us |",
        "|---|---|---|",
    ]
    for n in SIZES:
        d, f = results["decision"][n], results["fetch_order"][n]
        lines.append(
            f"| {n:,} | {d['median'] * 1e9:.0f} [{d['min'] * 1e9:.0f}, {d['max'] * 1e9:.0f}] "
            f"| {f['median'] * 1e6:.1f} |"
        )
    lines += [
        "",
        "The decision is O(1); the poll order lists every queue (BRPOP takes them all),",
        "so it is O(n) exactly like Kombu's round-robin cycle it replaces.",
    ]
    write("decision_cost", results, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
