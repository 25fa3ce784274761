"""Per-key limits: concurrency and rate held across two workers, and their cost.

Three experiments on a real Redis with real ``celery worker -P prefork``:

* **concurrency**: two workers ``-c 4`` (8 slots); keys ``k0..k9`` limited to 1 and
  ``wide`` to 3, tasks of 60 ms.  From the ledger of start and finish times: the
  most tasks of each key that ran at once, and how busy the 8 slots were while
  every key had work;
* **rate**: two workers ``-c 2``; key ``metered`` limited to 20/s with a long
  backlog, and four unlimited keys published at the same time.  The metered key's
  rate over ``--rate-seconds`` after its first second's burst, and when the
  unlimited keys finished;
* **cost**: throughput of one worker ``-c 2``, limits off against limits on
  (``"*"`` concurrency 1,000 and 100,000/s: checked at every fetch, never
  binding), with 10 and 10,000 keys waiting; alternating.  No-op tasks measure
  the fetch path alone; tasks that sleep ``--task-ms`` (10 and 50 ms by default)
  show what the limits cost at realistic task lengths, where the release and
  the fetch that follow each task leave its pool slot idle.

    python -m bench.key_limits [--reps 3] [--rate-seconds 30] [--task-ms 0,10,50]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, most_at_once, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer

from .common import environment, summary, write
from .keys_scale import fill, throughput

QUEUE = "limited"
#: The experiments, in the order they run.
PARTS = ("concurrency", "rate", "cost")
#: The options a reproduce line names when they differ from these defaults.
DEFAULTS = {"keys": "10,10000", "parts": ",".join(PARTS), "name": "key_limits"}


def _publish(url: str, counts: dict[str, int], ms: float) -> None:
    app = keyed_app(url, {QUEUE: "tenant_id"}, "key-limits-producer")
    publish_by_key(app, QUEUE, counts, ms)
    app.close()


def _workers(url: str, n: int, concurrency: int, env: dict[str, str]) -> list[WorkerProcess]:
    full = {"CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id", "CELERY_FAIR_LEDGER": url, **env}
    return [WorkerProcess(url, [QUEUE], concurrency=concurrency, env=full) for _ in range(n)]


def concurrency_run() -> dict[str, Any]:
    singles = {f"k{i}": 40 for i in range(10)}
    counts = {**singles, "wide": 120}
    with RedisServer() as server:
        _publish(server.url, counts, ms=60)
        ledger = Ledger(server.url)
        workers = _workers(server.url, 2, 4, {"CELERY_FAIR_KEY_CONCURRENCY": "*=1,wide=3"})
        try:
            for w in workers:
                w.start()
            assert ledger.wait_for(sum(counts.values()), timeout=300, alive=workers)
        finally:
            for w in workers:
                w.stop()
        entries = ledger.entries()
    most = most_at_once(entries)
    start = min(e.started for e in entries)
    end = min(max(e.started for e in entries if e.tenant == k) for k in counts)
    busy = sum(min(e.finished, end) - max(e.started, start) for e in entries if e.started < end)
    return {
        "most_single": max(most[k] for k in singles),
        "most_wide": most["wide"],
        "slots_busy": busy / (end - start) / 8,
        "window_s": end - start,
        "tasks": len({e.id for e in entries}),
    }


def rate_run(seconds: float) -> dict[str, Any]:
    rate = 20.0
    metered = int(rate * (seconds + 3))
    with RedisServer() as server:
        _publish(server.url, {"metered": metered}, ms=1)
        _publish(server.url, {f"free{i}": 250 for i in range(4)}, ms=1)
        ledger = Ledger(server.url)
        workers = _workers(server.url, 2, 2, {"CELERY_FAIR_KEY_RATE": f"metered={rate:g}/s"})
        try:
            for w in workers:
                w.start()
            assert ledger.wait_for(metered + 1000, timeout=seconds * 3 + 60, alive=workers)
        finally:
            for w in workers:
                w.stop()
        entries = sorted(ledger.entries(), key=lambda e: e.started)
    starts = [e.started for e in entries if e.tenant == "metered"]
    first = starts[int(rate)]  # after the bucket's first second's worth
    window = [t for t in starts if first <= t < first + seconds]
    free_done = max(e.finished for e in entries if e.tenant != "metered")
    return {
        "rate": (len(window) - 1) / (window[-1] - window[0]),
        "target": rate,
        "window_s": window[-1] - window[0],
        "free_done_after_s": free_done - starts[0],
        "metered_done_after_s": starts[-1] - starts[0],
        "per_second": dict(Counter(int(t - first) for t in window)),
    }


#: Seconds each napping-task throughput is measured over (the backlog is sized to outlast it).
NAP_SECONDS = 15.0
COST_CONCURRENCY = 2


def cost_run(keys: int, limited: bool, task_ms: float, consume: int) -> float:
    """One worker's tasks/s on a backlogged keyed queue, limits on or off."""
    env = (
        {"CELERY_FAIR_KEY_CONCURRENCY": "*=1000", "CELERY_FAIR_KEY_RATE": "*=100000/s"}
        if limited
        else {}
    )
    if task_ms:  # what the pool can do in NAP_SECONDS at best
        consume = int(NAP_SECONDS * COST_CONCURRENCY * 1000 / task_ms)
    warmup = max(50, consume // 8)
    with RedisServer() as server:
        fill(server.url, max(keys, consume + warmup + max(500, consume // 3)), keys, task_ms)
        return throughput(server.url, True, warmup, consume, env, COST_CONCURRENCY)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate-seconds", type=float, default=30.0)
    parser.add_argument("--consume", type=int, default=15_000)
    parser.add_argument("--task-ms", default="0,10,50", help="task lengths of the cost runs")
    parser.add_argument("--keys", default=DEFAULTS["keys"], help="keys waiting in the cost runs")
    parser.add_argument(
        "--parts", default=DEFAULTS["parts"], help=f"which experiments ({', '.join(PARTS)})"
    )
    parser.add_argument("--name", default=DEFAULTS["name"])
    args = parser.parse_args(argv)
    lengths = [float(x) for x in args.task_ms.split(",")]
    sizes = [int(x) for x in args.keys.split(",")]
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")
    results: dict[str, Any] = {"env": environment(), "args": vars(args)}
    if "concurrency" in parts:
        results["concurrency"] = [concurrency_run() for _ in range(args.reps)]
        print("concurrency", results["concurrency"], flush=True)
    if "rate" in parts:
        results["rate"] = [rate_run(args.rate_seconds) for _ in range(args.reps)]
        print("rate", [{k: v for k, v in r.items() if k != "per_second"} for r in results["rate"]])
    if "cost" in parts:
        cost: dict[str, list[float]] = results.setdefault("cost", {})
        for rep in range(args.reps):
            for ms in lengths:
                for keys in sizes:
                    order = [False, True] if rep % 2 == 0 else [True, False]
                    for limited in order:
                        label = _label(ms, keys, limited)
                        rate = cost_run(keys, limited, ms, args.consume)
                        cost.setdefault(label, []).append(rate)
                        print(f"rep {rep + 1} {label}: {rate:.0f} tasks/s", flush=True)
    write(args.name, results, _markdown(results))
    return 0


def _label(ms: float, keys: int, limited: bool) -> str:
    return f"{ms:g} ms, {keys} keys, limits {'on' if limited else 'off'}"


def _markdown(results: dict[str, Any]) -> str:
    env, args = results["env"], results["args"]
    options = "".join(
        f" --{name} {args[name]}" for name, default in DEFAULTS.items()
        if args.get(name, default) != default
    )  # fmt: skip
    lines = [
        "# Per-key limits",
        "",
        f"Reproduce: `python -m bench.key_limits --reps {args['reps']} --rate-seconds "
        f"{args['rate_seconds']:g} --task-ms {args['task_ms']}{options}` ({env['when']}, "
        f"celery {env['celery']}, kombu {env['kombu']}, {env['cpus']} CPUs). "
        f"Medians over {args['reps']} runs [min, max].",
        "",
    ]
    if "concurrency" in results:
        conc = results["concurrency"]
        lines += [
            "## Concurrency across two workers",
            "",
            "Two workers `-P prefork -c 4` (8 slots), keys k0..k9 limited to 1 and `wide` to "
            "3, tasks of 60 ms; from the ledger of start and finish times.",
            "",
            "| measure | result |",
            "|---|---|",
            f"| most tasks of one 1-limited key at once (worst over runs) | "
            f"{max(r['most_single'] for r in conc)} |",
            f"| most tasks of `wide` (limit 3) at once | "
            f"{', '.join(str(r['most_wide']) for r in conc)} |",
            f"| slots busy while every key had work | "
            f"{_pct(summary([r['slots_busy'] for r in conc]))} |",
            f"| tasks run, of {conc[0]['tasks']} published | "
            f"{', '.join(str(r['tasks']) for r in conc)} |",
            "",
        ]
    if "rate" in results:
        rate = results["rate"]
        lines += [
            "## Rate across two workers",
            "",
            f"Two workers `-c 2`; `metered` limited to {rate[0]['target']:g}/s, four "
            "unlimited keys of 250 tasks each published at the same time; rate over "
            f"{args['rate_seconds']:g} s after the first second's burst.",
            "",
            "| measure | result |",
            "|---|---|",
            f"| metered key's rate (tasks/s) | {_num(summary([r['rate'] for r in rate]))} |",
            f"| error against {rate[0]['target']:g}/s (worst) | "
            f"{max(abs(r['rate'] / r['target'] - 1) for r in rate):.1%} |",
            f"| unlimited keys done after (s) | "
            f"{_num(summary([r['free_done_after_s'] for r in rate]))} |",
            f"| metered key done after (s) | "
            f"{_num(summary([r['metered_done_after_s'] for r in rate]))} |",
            "",
        ]
    if "cost" in results:
        cost = results["cost"]
        lines += [
            "## Cost",
            "",
            f"One worker `-c {COST_CONCURRENCY}`, the queue backlogged throughout; limits on "
            "= every key checked against a concurrency of 1,000 and 100,000/s (never "
            "binding). No-op tasks (0 ms) measure the fetch path alone; tasks that sleep "
            "show the cost at realistic lengths (measured over about "
            f"{NAP_SECONDS:g} s of the pool's time). *On / off*: the ratio of each "
            "repetition's pair, run in turns. *Pool bound*: the most a pool of this size "
            "can run, concurrency / task length.",
            "",
            "| task | keys waiting | limits off (tasks/s) | limits on (tasks/s) | on / off | "
            "pool bound |",
            "|---|---|---|---|---|---|",
        ]
        for ms in (float(x) for x in args["task_ms"].split(",")):
            for keys in (int(x) for x in args.get("keys", DEFAULTS["keys"]).split(",")):
                offs, ons = cost[_label(ms, keys, False)], cost[_label(ms, keys, True)]
                paired = summary([on / off for on, off in zip(ons, offs, strict=True)])
                bound = f"{COST_CONCURRENCY * 1000 / ms:,.0f}" if ms else "-"
                lines.append(
                    f"| {'no-op' if not ms else f'{ms:g} ms'} | {keys:,} | "
                    f"{_num(summary(offs), ',.0f')} | {_num(summary(ons), ',.0f')} | "
                    f"{_pct(paired)} | {bound} |"
                )
    return "\n".join([*lines, ""])


def _num(d: dict[str, float], spec: str = ".2f") -> str:
    return f"{d['median']:{spec}} [{d['min']:{spec}}, {d['max']:{spec}}]"


def _pct(d: dict[str, float]) -> str:
    return f"{d['median']:.1%} [{d['min']:.1%}, {d['max']:.1%}]"


if __name__ == "__main__":
    sys.exit(main())
