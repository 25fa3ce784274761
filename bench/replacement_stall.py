"""How long a task waits while a prefork worker replaces its children, against plain Celery.

One ``celery worker -P prefork -c 2 --max-tasks-per-child=20`` of
``tests.integration.production_app`` (late acks, a prefetch multiplier of 1,
``-E -O fair``, a hard ``--time-limit``: the churn soak's worker ``b`` without
the churn) drains ``--tasks`` tasks of 2 ms from two queues weighted 4:1.
From the worker's log: each task's wait from "received" to "succeeded", the
longest of them, and how many waited more than ``--over`` seconds. plain
Celery and celery-fair run in turns, ``--reps`` times each, on one broker.

Found in the churn test on RabbitMQ: when both children reached the limit at
once, the tasks the worker held could wait 2-5 s for the pool's maintenance
timer. Celery's pool had read each child's exit before the child could be
joined, and no longer watched it (celery#9588, plain Celery too, less often);
celery-fair now looks again until it can (``compat.follow_process_exits``).

    python -m bench.replacement_stall [--broker rabbitmq] [--reps 3] [--tasks 3000]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tests.harness.churn import task_waits
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.rabbitmq import RabbitMQServer
from tests.harness.redis import RedisServer
from tests.integration.production_app import make_app

from .common import environment, summary, write

APP = "tests.integration.production_app"
QUEUES = {"hi": 4, "lo": 1}
FLAGS = ("-E", "-O", "fair", "--time-limit=1.5", "--max-tasks-per-child=20")


def one_run(url: str, backend: str, fair: bool, args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "CELERY_FAIR_BROKER": url,
        "CELERY_FAIR": "1" if fair else "0",
        "PRODUCTION_BACKEND": backend,
        "PRODUCTION_WEIGHTS": ",".join(f"{q}={w}" for q, w in QUEUES.items()),
    }
    producer = make_app({**env, "PRODUCTION_BACKEND": ""}, name="stall-producer")
    try:
        with producer.producer_or_acquire() as p:
            for _ in range(args.tasks // len(QUEUES)):
                for q in QUEUES:
                    producer.send_task(
                        "prod.churn", args=(q,), kwargs={"ms": 2}, queue=q, producer=p
                    )
    finally:
        producer.close()
    worker = WorkerProcess(url, list(QUEUES), fair=fair, app=APP, env=env, extra_args=FLAGS)
    total = args.tasks // len(QUEUES) * len(QUEUES)
    with worker:
        t0 = time.monotonic()
        drained = poll_until(lambda: worker.log().count(" succeeded ") >= total, timeout=600)
        elapsed = time.monotonic() - t0
        log = worker.log()
    assert drained, log[-3000:]
    w = task_waits(log)
    return {
        "tasks": len(w),
        "wall_s": elapsed,
        "longest_wait_s": max(w),
        "waits_over": sum(x > args.over for x in w),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("rabbitmq", "redis"), default="rabbitmq")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--over", type=float, default=2.0, help="a wait longer than this counts")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "fair": []}
    with RedisServer() as redis_server:
        backend = redis_server.url.rsplit("/", 1)[0] + "/1"
        server = RabbitMQServer() if args.broker == "rabbitmq" else RedisServer()
        with server:
            for rep in range(args.reps):
                order = ("fair", "plain") if rep % 2 == 0 else ("plain", "fair")
                for variant in order:
                    res = one_run(server.url, backend, variant == "fair", args)
                    runs[variant].append(res)
                    print(f"rep {rep + 1} {variant:5} longest wait {res['longest_wait_s']:.2f} s, "
                          f"{res['waits_over']} over {args.over:g} s, wall {res['wall_s']:.1f} s",
                          flush=True)  # fmt: skip
    data = {
        "env": environment(),
        "args": vars(args),
        "results": {
            v: {
                "longest_wait_s": summary([r["longest_wait_s"] for r in reps]),
                "waits_over": summary([float(r["waits_over"]) for r in reps]),
                "wall_x_plain": summary(
                    [r["wall_s"] / p["wall_s"] for r, p in zip(reps, runs["plain"], strict=True)]
                ),
                "runs": reps,
            }
            for v, reps in runs.items()
        },
    }
    write(args.name or f"replacement_stall_{args.broker}", data, _markdown(data))
    return 0


def _markdown(data: dict[str, Any]) -> str:
    a, env = data["args"], data["env"]
    name = f" --name {a['name']}" if a.get("name") else ""
    lines = [
        "# Waits while a prefork worker replaces its children",
        "",
        f"Reproduce: `python -m bench.replacement_stall --broker {a['broker']} --reps {a['reps']} "
        f"--tasks {a['tasks']}{name}` ({env['when']}, celery {env['celery']}, "
        f"kombu {env['kombu']}). "
        "One worker `-P prefork -c 2 --max-tasks-per-child=20`, late acks, prefetch "
        "multiplier 1, 2 ms tasks; plain Celery and celery-fair in turns. Median [min, max].",
        "",
        f"| variant | longest received-to-done wait, s | tasks waiting over {a['over']:g} s "
        "| wall time x plain |",
        "|---|---|---|---|",
    ]
    for variant, r in data["results"].items():
        cells = [
            f"{r[k]['median']:.2f} [{r[k]['min']:.2f}, {r[k]['max']:.2f}]"
            for k in ("longest_wait_s", "waits_over", "wall_x_plain")
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
