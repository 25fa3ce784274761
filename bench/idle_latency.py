"""Idle round trip: from publishing a task to an idle worker until it starts.

An idle worker waits for work.  Plain Celery waits in ``BRPOP``, which Redis
answers the moment a message arrives; celery-fair's atomic fetch waits in a
``BLPOP`` on a private key that a listener of Redis's client-side tracking
invalidations pushes (see ``celery_fair.kombu.wakeup``).  This measures the
two side by side, alternating, in the installed versions (run it in each
version set: the protocol of the fetch connection is RESP2 with redis-py
before 8, RESP3 from 8).  Each sample: one ``ledger`` task published after
the worker has been idle for ``--gap`` seconds; the latency is the task's
start (its own clock) minus the publish time (same machine).

    python -m bench.idle_latency [--samples 60] [--reps 3] [--name idle_latency]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import redis as redis_lib

from tests.harness.control import control_app
from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer

from .common import environment, summary, write

MODES = {
    "plain": {"fair": False, "env": {}},
    "fair": {"fair": True, "env": {}},
    "fair, atomic fetch off": {"fair": True, "env": {"CELERY_FAIR_ATOMIC": "0"}},
}


def _wait_idle_worker(client: redis_lib.Redis, producer: Any, worker: WorkerProcess) -> None:
    """Until the worker has run a first task (it is up and consuming)."""
    producer.send_task("ledger", args=(0,), queue="idle")
    deadline = time.monotonic() + 60
    while client.llen("ledger") < 1:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        if time.monotonic() > deadline:
            raise TimeoutError(worker.log()[-3000:])
        time.sleep(0.05)
    client.delete("ledger", "ledger:recorded")


def sample(url: str, mode: str, samples: int, gap: float) -> list[float]:
    """``samples`` publish-to-start latencies (seconds) with one worker of ``mode``."""
    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    spec = MODES[mode]
    env = {"CELERY_FAIR_LEDGER": url, **spec["env"]}
    producer = control_app(url)
    latencies: list[float] = []
    try:
        with WorkerProcess(url, ["idle"], fair=spec["fair"], env=env, concurrency=1) as worker:
            _wait_idle_worker(client, producer, worker)
            for _ in range(samples):
                time.sleep(gap)  # idle: the worker is waiting for work
                sent = time.time()
                producer.send_task("ledger", args=(0,), queue="idle")
                deadline = time.monotonic() + 10
                while (raw := client.lpop("ledger")) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(worker.log()[-3000:])
                    time.sleep(0.001)
                latencies.append(json.loads(raw)["started"] - sent)
    finally:
        producer.close()
    return latencies


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"env": environment(), "params": vars(args), "modes": {}}
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    medians: dict[str, list[float]] = {m: [] for m in MODES}
    with RedisServer() as server:
        for rep in range(args.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                found = sample(server.url, mode, args.samples, args.gap)
                per_mode[mode] += found
                medians[mode].append(statistics.median(found))
                print(f"rep {rep} {mode:24} median {1000 * medians[mode][-1]:7.2f} ms", flush=True)
    for mode, values in per_mode.items():
        ordered = sorted(values)
        results["modes"][mode] = {
            "median_ms": 1000 * statistics.median(ordered),
            "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
            "max_ms": 1000 * ordered[-1],
            "median_per_rep_ms": summary([1000 * m for m in medians[mode]]),
            "samples": len(values),
        }
    return results


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    p = results["params"]
    lines = [
        "# Idle round trip: publish to start on an idle worker (Redis)",
        "",
        f"Reproduce: `python -m bench.idle_latency --samples {p['samples']} --reps {p['reps']}` "
        f"({env['when']}; celery {env['celery']}, kombu {env['kombu']}, redis-py "
        f"{env['redis']}; {p['reps']} alternating repetitions of {p['samples']} tasks, "
        f"each after {p['gap']} s idle, `-c 1`).",
        "",
        "| worker | median | p90 | max | median per repetition [min, max] |",
        "|---|---|---|---|---|",
    ]
    for mode, d in results["modes"].items():
        r = d["median_per_rep_ms"]
        lines.append(
            f"| {mode} | {d['median_ms']:.2f} ms | {d['p90_ms']:.2f} ms | {d['max_ms']:.1f} ms "
            f"| {r['median']:.2f} ms [{r['min']:.2f}, {r['max']:.2f}] |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.25, help="idle seconds before each task")
    parser.add_argument("--name", default="idle_latency")
    args = parser.parse_args(argv)
    results = run(args)
    text = markdown(results)
    write(args.name, results, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
