"""What a real worker costs the broker per task, and its throughput, against plain Celery.

For each variant a fresh ``redis-server`` receives ``--tasks`` no-op tasks (the
workload's ``ledger`` task, ``ms=0``, with a ``tenant_id`` over ``N`` keys),
published by a Celery producer; then one ``celery worker`` (``-P threads -c 4``
by default, Celery's defaults otherwise) drains them.  Measured over the drain,
from ``--warmup`` tasks in until ``--tail`` are left (the queue stays
backlogged): the broker's CPU per task (``used_cpu_user`` + ``used_cpu_sys`` of
``INFO cpu``, network included) and the tasks per second.  The publish is
measured the same way (Kombu's ``LPUSH``, or the keyed publish script).

Variants:

* ``plain``: plain Celery on a plain queue, the anchor (Kombu's ``BRPOP``);
* ``fair``: celery-fair on the same plain queue (the atomic fetch);
* ``keyed-N``: ``fair_keys`` over N keys;
* ``limits-N``: the same with per-key limits on, ``fair_key_concurrency =
  {"*": 4}`` and ``fair_key_rate_limit = {"*": "100000/s"}``: checked at every
  fetch, never binding;
* ``capped-N``: ``fair_keys`` over N keys with every key's backlog capped
  (``fair_key_max_backlog = {"*": tasks}``, never binding): on Redis the push
  script counts, on RabbitMQ a marker per task in the key's counter (a
  confirmed publish in the producer, a ``basic.get`` in the worker);
* ``durable-N``: ``capped-N`` with ``fair_key_max_backlog_durable``: on RabbitMQ
  each marker persistent, its confirm sent once it is on disk.

Variants run in turns (A B C, B C A, ...), ``--reps`` times; each figure is
also given over ``plain``'s in the same round, so it holds on any day.  The
worker's ``inspect fair_stats`` gives the messages per fetch script call.
The producer's publishes per second (wall time, one thread) are given over
plain's too: a capped publish on RabbitMQ waits for its marker's confirm.

With ``--broker rabbitmq`` the same on a fresh RabbitMQ (variants ``plain``,
``fair``, ``keyed-N``, and ``limits-N`` with the concurrency limit alone, a
token taken and given back per task, its set minted as each key first runs:
:mod:`celery_fair.keys.tokens`): the broker's CPU is the
node's process time (``/proc/<pid>/stat``), and what waits is read four times
a second with passive declares of the queue and its 24 lanes
(:mod:`celery_fair.keys.lanes`), in every variant alike (the lanes are
declared, empty, for the plain ones), so the reads cost every variant the same.

    python -m bench.broker_cost [--variants plain,fair,keyed-1000,limits-1000,limits-10000]
                                [--reps 3] [--tasks 12000] [--pool threads -c 4]
                                [--broker redis|rabbitmq]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis as redis_lib
from kombu.entity import Queue

from celery_fair.keys.layout import BACKLOG, KeyedNames
from tests.harness.control import wait_fair_stats
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE = "jobs"
VARIANTS = ("plain", "fair", "keyed-1000", "limits-1000", "limits-10000")
RABBITMQ_VARIANTS = ("plain", "fair", "keyed-10", "keyed-1000", "keyed-10000")
#: Seconds between two reads of what waits on RabbitMQ (25 passive declares each).
RABBITMQ_POLL = 0.25


class _Redis:
    """A fresh ``redis-server``: its CPU from ``INFO cpu``, what waits from its lists."""

    poll = 0.005

    def __init__(self) -> None:
        self.server = RedisServer()

    def __enter__(self) -> _Redis:
        self.server.start()
        self.url = self.server.url
        self.client = redis_lib.Redis.from_url(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    def cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def waiting(self, variant: str) -> int:
        """Messages still in the queue (not yet fetched by the worker)."""
        if _keys(variant):
            return int(self.client.hget(KeyedNames(QUEUE).state, BACKLOG) or 0)
        return int(self.client.llen(QUEUE))


class _RabbitMQ:
    """A fresh RabbitMQ node: its process time, what waits in the queue and its lanes."""

    poll = RABBITMQ_POLL

    def __init__(self) -> None:
        from tests.harness.rabbitmq import RabbitMQServer

        self.server = RabbitMQServer()

    def __enter__(self) -> _RabbitMQ:
        from kombu.connection import Connection

        from celery_fair.keys.lanes import KeyLanes, lane_queue

        self.server.start()
        self.url = self.server.url
        self.connection = Connection(self.url)  # type: ignore[no-untyped-call]
        channel = self.connection.channel()
        parent = Queue(QUEUE)  # type: ignore[no-untyped-call]
        parent(channel).declare()
        for lane in KeyLanes(frozenset((QUEUE,))).lanes(QUEUE):
            lane_queue(parent, lane)(channel).declare()
        channel.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.connection.release()
        self.server.close()

    def cpu(self) -> float:
        pid = self.server.pid
        assert pid is not None, "the node wrote no pid file"
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def waiting(self, variant: str) -> int:
        from celery_fair.keys.lanes_admin import backlog

        return sum(c.messages or 0 for c in backlog(self.connection, QUEUE))


def _keys(variant: str) -> int:
    return int(variant.split("-")[1]) if "-" in variant else 0


def _producer(url: str, variant: str, tasks: int) -> Any:
    if variant.startswith(("capped", "durable")):
        return keyed_app(url, {QUEUE: "tenant_id"}, fair_key_max_backlog={"*": tasks},
                         fair_key_max_backlog_durable=variant.startswith("durable"))  # fmt: skip
    if _keys(variant):
        return keyed_app(url, {QUEUE: "tenant_id"})
    from celery import Celery

    return Celery("broker-cost-producer", broker=url, set_as_current=False)


def _publish(broker: Any, variant: str, tasks: int) -> tuple[float, float]:
    """Publish ``tasks`` no-op tasks, the keys in turn: the broker's CPU µs per task,
    and the publishes per second."""
    app = _producer(broker.url, variant, tasks)
    keys = max(1, _keys(variant))
    try:
        with app.producer_or_acquire() as producer:
            cpu0, t0 = broker.cpu(), time.perf_counter()
            for i in range(tasks):
                app.send_task(
                    "ledger", kwargs={"ms": 0, "tenant_id": f"t{i % keys}"}, queue=QUEUE,
                    producer=producer,
                )  # fmt: skip
            elapsed = time.perf_counter() - t0
            return (broker.cpu() - cpu0) / tasks * 1e6, tasks / elapsed
    finally:
        app.close()


def _worker(url: str, variant: str, args: argparse.Namespace) -> WorkerProcess:
    env: dict[str, str] = {}
    if _keys(variant):
        env["CELERY_FAIR_KEYS"] = f"{QUEUE}=tenant_id"
    if variant.startswith("limits"):
        env["CELERY_FAIR_KEY_CONCURRENCY"] = "*=4"
        if args.broker != "rabbitmq":
            # On RabbitMQ a rate is a set of token messages per key, minted as the
            # key first runs: the concurrency token alone is measured there.
            env["CELERY_FAIR_KEY_RATE"] = "*=100000/s"
    return WorkerProcess(
        url, [QUEUE], pool=args.pool, concurrency=args.concurrency,
        fair=variant != "plain", env=env,
    )  # fmt: skip


def one_run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant on a fresh server: publish, then drain with one worker."""
    with _RabbitMQ() if args.broker == "rabbitmq" else _Redis() as broker:
        publish_us, publish_per_s = _publish(broker, variant, args.tasks)
        # RabbitMQ counts a publish once its queue has taken it: a moment after the send.
        deadline = time.monotonic() + 30
        while (arrived := broker.waiting(variant)) != args.tasks:
            assert time.monotonic() < deadline, f"the publish did not arrive whole: {arrived}"
            time.sleep(0.1)
        mint_ms = None
        if args.broker == "rabbitmq" and variant.startswith("limits"):
            mint_ms = _premint(broker.url, _keys(variant))
        start_at, stop_at = args.tasks - args.warmup, args.tail
        with _worker(broker.url, variant, args) as worker:
            deadline = time.monotonic() + args.timeout
            while (left := broker.waiting(variant)) > start_at:
                assert time.monotonic() < deadline, worker.log()[-3000:]
                time.sleep(broker.poll)
            cpu0, t0 = broker.cpu(), time.perf_counter()
            while (now_left := broker.waiting(variant)) > stop_at:
                assert time.monotonic() < deadline, worker.log()[-3000:]
                time.sleep(max(broker.poll, 0.02))
            elapsed, cpu1 = time.perf_counter() - t0, broker.cpu()
            stats = {} if variant == "plain" else wait_fair_stats(broker.url)
        n = left - now_left
    fetch = stats.get("atomic_fetch") or {}
    calls, fetches = fetch.get("calls") or 0, fetch.get("fetches") or 0
    return {
        "publish_us": publish_us,
        "publish_per_s": publish_per_s,
        "drain_us": (cpu1 - cpu0) / n * 1e6,
        "tasks_per_s": n / elapsed,
        "per_call": fetches / calls if calls else None,
        "mint_ms": mint_ms,
    }


def _premint(url: str, keys: int) -> float:
    """Mint every key's concurrency tokens before the drain, as a worker would as each
    key first runs; the drain then measures a task's own cost.  Returns ms per key."""
    from kombu.connection import Connection

    from celery_fair.keys.limits import KeyLimits
    from celery_fair.keys.token_client import TokenClient
    from celery_fair.keys.tokens import token_specs

    limits = KeyLimits(concurrency={"*": 4})
    specs = [spec for i in range(keys) for spec in token_specs(limits, QUEUE, f"t{i}")]
    client = TokenClient(lambda: Connection(url))  # type: ignore[no-untyped-call]
    t0 = time.perf_counter()
    try:
        deadline = time.monotonic() + 600
        while not all([client.minter.ready(spec) for spec in specs]):
            assert time.monotonic() < deadline, "the tokens were not minted in 10 minutes"
            time.sleep(0.05)
        return (time.perf_counter() - t0) / keys * 1000
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    parser.add_argument("--variants", default=None, help="default: every variant of the broker")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=12_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--tail", type=int, default=1_000)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("-c", "--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--name", default="broker_cost")
    args = parser.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(RABBITMQ_VARIANTS if args.broker == "rabbitmq" else VARIANTS)
    variants = args.variants.split(",")
    if "plain" not in variants:
        variants.insert(0, "plain")  # the anchor of every ratio
    if args.tasks <= args.warmup + args.tail:
        parser.error("--tasks must exceed --warmup + --tail")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        turn = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for variant in turn:
            res = one_run(variant, args)
            runs[variant].append(res)
            batch = f", {res['per_call']:.2f} per fetch call" if res["per_call"] else ""
            print(
                f"rep {rep + 1} {variant:14} publish {res['publish_us']:6.1f} us, drain "
                f"{res['drain_us']:6.1f} us CPU/task, {res['tasks_per_s']:6.0f} tasks/s{batch}",
                flush=True,
            )
    data = {"env": environment(), "args": vars(args), "results": _results(runs)}
    write(args.name, data, _markdown(data))
    return 0


def _results(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: each figure's summary, and over plain's in the same round."""
    plain = runs["plain"]
    out: dict[str, Any] = {}
    for variant, reps in runs.items():
        total = [r["publish_us"] + r["drain_us"] for r in reps]
        base = [p["publish_us"] + p["drain_us"] for p in plain]
        per_call = [r["per_call"] for r in reps if r["per_call"]]
        out[variant] = {
            "publish_us": summary([r["publish_us"] for r in reps]),
            "drain_us": summary([r["drain_us"] for r in reps]),
            "total_us": summary(total),
            "x_plain": summary([t / b for t, b in zip(total, base, strict=True)]),
            "drain_x_plain": summary(
                [r["drain_us"] / p["drain_us"] for r, p in zip(reps, plain, strict=True)]
            ),
            "throughput_x_plain": summary(
                [r["tasks_per_s"] / p["tasks_per_s"] for r, p in zip(reps, plain, strict=True)]
            ),
            "publish_rate_x_plain": summary(
                [r["publish_per_s"] / p["publish_per_s"] for r, p in zip(reps, plain, strict=True)]
            )
            if all("publish_per_s" in r for r in (*reps, *plain))
            else None,
            "tasks_per_s": summary([r["tasks_per_s"] for r in reps]),
            "per_call": statistics.median(per_call) if per_call else None,
            "mint_ms": summary(mints)
            if (mints := [r["mint_ms"] for r in reps if r.get("mint_ms")])
            else None,
            "runs": reps,
        }
    return out


def _cell(s: dict[str, float], fmt: str, suffix: str = "") -> str:
    return f"{s['median']:{fmt}}{suffix} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def _markdown(data: dict[str, Any]) -> str:
    a, env = data["args"], data["env"]
    lines = [
        "# What a real worker costs the broker per task, against plain Celery",
        "",
        f"Reproduce: `python -m bench.broker_cost --broker {a.get('broker', 'redis')} "
        f"--variants {a['variants']} --reps {a['reps']} "
        f"--tasks {a['tasks']} --pool {a['pool']} -c {a['concurrency']}` ({env['when']}, "
        f"celery {env['celery']}, kombu {env['kombu']}, redis-py {env['redis']}, "
        f"{env['cpus']} CPUs). One `celery worker -P {a['pool']} -c {a['concurrency']}` "
        f"drains {a['tasks']:,} no-op tasks, measured from {a['warmup']:,} in until "
        f"{a['tail']:,} are left; the variants in turns. Median [min, max] over "
        f"{a['reps']} rounds; \"x plain\" is each round's figure over plain Celery's "
        "in the same round.",
        "",
        "| variant | publish, µs CPU/task | drain, µs CPU/task | total x plain "
        "| drain x plain | tasks/s x plain | publishes/s x plain | messages per fetch call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in data["results"].items():
        per_call = "-" if r["per_call"] is None else f"{r['per_call']:.2f}"
        rate = r.get("publish_rate_x_plain")
        lines.append(
            f"| {variant} | {_cell(r['publish_us'], '.1f')} | {_cell(r['drain_us'], '.1f')} "
            f"| {_cell(r['x_plain'], '.2f', 'x')} | {_cell(r['drain_x_plain'], '.2f', 'x')} "
            f"| {_cell(r['throughput_x_plain'], '.2f', 'x')} "
            f"| {'-' if rate is None else _cell(rate, '.2f', 'x')} | {per_call} |"
        )
    minted = {v: r["mint_ms"] for v, r in data["results"].items() if r.get("mint_ms")}
    if minted:
        lines += [
            "",
            "RabbitMQ's `limits-N`: each key's concurrency tokens were minted before the "
            "drain, one key after another as a worker's minter does, in "
            + ", ".join(f"{_cell(m, '.1f', ' ms')} per key ({v})" for v, m in minted.items())
            + "; the drain measures a task's own token round trips.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
