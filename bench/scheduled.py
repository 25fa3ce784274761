"""Scheduled work on the broker (``fair_eta = "broker"``): duplicates, hoarding, lateness.

The evidence of the issue "Scheduled work on the broker", on a real
``redis-server`` (a fresh one per case, on loopback) and the real ``celery
worker`` started with Celery's defaults (prefork, concurrency = the CPU
count), running ``tests/integration/scheduled_app.py``: each task run
appends a record (start time, the ``eta`` header it carried, the ``fair_due``
celery-fair stamped) to a ledger list on the same Redis.  celery-fair's
producer has ``fair_eta="broker"``; "plain Celery" is the same app and the
same script without ``celery_fair.install`` (``SCHED_FAIR=0``).

``visibility``
    ``visibility_timeout`` 4 s with Kombu's restore sweep every second
    (``unacked_restore_interval=1``, ``unacked_restore_throttle=1``, as
    ``scheduled_app`` sets them with ``SCHED_VISIBILITY``).  40 tasks with
    ``countdown=12`` on a plain queue and on a keyed queue (``fair_keys``, 3
    tenants).  The run waits until countdown + 3 x visibility + 5 s after the
    last send, then until nothing is left unacknowledged (at most 30 s more),
    and counts runs per task: total runs, tasks run more than once, the most
    runs of one task.
``hoard``
    20,000 tasks of one key of a keyed queue with ``countdown=3600``.  Before
    publishing, the RSS of the worker (main process plus its pool processes,
    ``/proc``) is sampled for 5 s after start-up; after publishing (and, for
    plain Celery, once the worker has fetched every task: Redis's unacked
    index holds all of them) it is sampled once a second for ``--hoard-sample``
    seconds.  Then ``inspect().scheduled()`` and ``reserved()`` are counted,
    and the broker's ``used_memory`` and the ``MEMORY USAGE`` of the schedule
    (celery-fair) or of the unacked index (plain Celery) are read.
``ontime``
    Tasks with ``countdown=3``, sent at a steady rate the worker keeps up with
    (no-op tasks), so that the lateness measures the schedule, not a backlog
    (the largest ready backlog seen while sending is reported).  Lateness is
    the task's start minus its eta (the ``eta`` header): p50, p99, max, and
    how many started before their eta.  Cases: 10 keys; 10,000 keys (one task
    each); 10 keys with 1,000,000 other tasks waiting in the same queue's
    schedule, due in an hour (bulk-loaded with ``ZADD`` in pipelines before the
    worker starts: envelopes of the shape ``store.schedule`` writes, around
    small Kombu-shaped payloads of a task that is never registered: they never
    come due during the run); and plain Celery with the 10-key load (the
    worker holds the tasks on its ETA timer), the anchor.

Each scenario is bounded in time and stops its workers and servers itself.

    python -m bench.scheduled [--scenarios visibility,hoard,ontime] [--name scheduled]
        [--hoard-tasks 20000] [--hoard-sample 40] [--ontime-tasks 600] [--ontime-rate 50]
        [--ontime-keys-tasks 10000] [--ontime-keys-rate 200] [--waiting 1000000]

Writes ``bench/results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis as redis_lib
from celery import Celery

import celery_fair
from celery_fair.keys import store
from celery_fair.keys.eta import due_time
from celery_fair.keys.layout import KeyedNames
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.ledger import percentile
from tests.harness.memory import rss_bytes
from tests.harness.redis import RedisServer

from .common import environment, write

APP = "tests.integration.scheduled_app"
PLAIN, KEYED = "sched", "jobs"
KEYS_SPEC = f"{KEYED}=tenant_id"
#: Celery's default concurrency: the CPU count.
CONCURRENCY = os.cpu_count() or 1
UNACKED = "unacked"  # Kombu's default ``unacked_key``


# -- shared pieces ------------------------------------------------------------------


@contextmanager
def broker() -> Iterator[RedisServer]:
    """A fresh redis-server for one case: nothing left from the one before."""
    with RedisServer() as server:
        yield server


def producer(url: str, fair: bool, keyed: bool) -> Celery:
    app = Celery("sched_bench_producer", broker=url, set_as_current=False)
    app.conf.task_ignore_result = True
    if fair:
        app.conf.fair_eta = "broker"
        if keyed:
            app.conf.fair_keys = {KEYED: "tenant_id"}
        celery_fair.install(app)
    return app


def worker(url: str, queue: str, fair: bool, keyed: bool, **env: str) -> WorkerProcess:
    """The real ``celery worker`` with Celery's defaults (prefork, concurrency = CPUs)."""
    full = {"SCHED_LEDGER": url, **env}
    if fair:
        full["SCHED_ETA"] = "broker"
        if keyed:
            full["SCHED_KEYS"] = KEYS_SPEC
    else:
        full["SCHED_FAIR"] = "0"
    return WorkerProcess(url, [queue], concurrency=CONCURRENCY, app=APP, env=full)


def start(w: WorkerProcess) -> WorkerProcess:
    w.start()
    if not poll_until(lambda: " ready." in w.log(), 90):
        w.stop()
        raise RuntimeError(f"the worker did not start:\n{w.log()[-3000:]}")
    return w


def runs(client: Any) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange("sched.ran", 0, -1)]


def mode_name(fair: bool) -> str:
    return 'celery-fair, fair_eta="broker"' if fair else "plain Celery"


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of ``pid`` plus its children's, number of children), bytes, from ``/proc``."""
    total, children = rss_bytes(pid), 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, kids):
            try:
                total += rss_bytes(child)
                children += 1
            except (OSError, RuntimeError):
                continue
    return total, children


def mib(n: float) -> float:
    return round(n / 2**20, 1)


# -- visibility ---------------------------------------------------------------------

VISIBILITY, VIS_COUNTDOWN, VIS_TASKS, VIS_TENANTS, VIS_MARGIN = 4.0, 12.0, 40, 3, 5.0


def queue_label(fair: bool, keyed: bool) -> str:
    if not keyed:
        return "plain"
    # Plain Celery has no keyed queue: the same tasks, tenant argument and all, in one list.
    return "keyed (fair_keys, 3 tenants)" if fair else "the keyed case's tasks (no fair_keys)"


def visibility_case(fair: bool, keyed: bool) -> dict[str, Any]:
    queue = KEYED if keyed else PLAIN
    with broker() as server:
        client = redis_lib.Redis.from_url(server.url)
        app = producer(server.url, fair, keyed)
        w = start(worker(server.url, queue, fair, keyed, SCHED_VISIBILITY=str(VISIBILITY)))
        try:
            for n in range(VIS_TASKS):
                app.send_task(
                    "sched.record", args=[n], kwargs={"tenant_id": f"t{n % VIS_TENANTS}"},
                    countdown=VIS_COUNTDOWN, queue=queue,
                )  # fmt: skip
            sent = time.monotonic()
            scheduled = store.scheduled(client, KeyedNames(queue))
            poll_until(lambda: client.llen("sched.ran") >= VIS_TASKS, VIS_COUNTDOWN + 60)
            # Long enough for restores past the visibility timeout to be delivered and run.
            wait_until = sent + VIS_COUNTDOWN + 3 * VISIBILITY + VIS_MARGIN
            time.sleep(max(0.0, wait_until - time.monotonic()))
            drained = poll_until(lambda: client.hlen(UNACKED) == 0, 30)
            waited = time.monotonic() - sent
            unacked_left = int(client.hlen(UNACKED))
        finally:
            w.stop()
            app.close()
        counts = Counter(r["n"] for r in runs(client))
        client.close()
    result = {
        "mode": mode_name(fair),
        "queue": queue_label(fair, keyed),
        "tasks": VIS_TASKS,
        "scheduled_on_broker_after_send": scheduled,
        "tasks_run": len(counts),
        "total_runs": sum(counts.values()),
        "tasks_run_more_than_once": sum(1 for c in counts.values() if c > 1),
        "max_runs": max(counts.values(), default=0),
        "never_run": VIS_TASKS - len(counts),
        "seconds_waited_after_send": round(waited, 1),
        "unacked_drained": drained,
        "unacked_left": unacked_left,
    }
    print(f"visibility {result}", flush=True)
    return result


def visibility() -> dict[str, Any]:
    cases = [visibility_case(fair, keyed) for fair in (True, False) for keyed in (False, True)]
    return {
        "visibility_timeout_s": VISIBILITY,
        "countdown_s": VIS_COUNTDOWN,
        "tasks": VIS_TASKS,
        "cases": cases,
    }


def visibility_md(data: dict[str, Any]) -> list[str]:
    lines = [
        "## visibility: a task held past the visibility timeout",
        "",
        f"`visibility_timeout` {data['visibility_timeout_s']:g} s, Kombu's restore sweep "
        f"every second; {data['tasks']} tasks with `countdown={data['countdown_s']:g}`; "
        "counted after countdown + 3 x visibility + 5 s, once nothing is left unacknowledged.",
        "",
        "| mode | queue | in the broker's schedule after sending | total runs "
        "| tasks run > 1 time | max runs of one task | never run | unacked left |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cases"]:
        lines.append(
            f"| {c['mode']} | {c['queue']} | {c['scheduled_on_broker_after_send']} | "
            f"{c['total_runs']} | "
            f"{c['tasks_run_more_than_once']} | {c['max_runs']} | {c['never_run']} | "
            f"{c['unacked_left']} |"
        )
    return lines + [""]


# -- hoard --------------------------------------------------------------------------


def sample_rss(pid: int, seconds: float, every: float = 1.0) -> list[int]:
    samples: list[int] = []
    end = time.monotonic() + seconds
    while True:
        samples.append(tree_rss(pid)[0])
        if time.monotonic() + every > end:
            return samples
        time.sleep(every)


def count_inspect(app: Celery, timeout: float) -> dict[str, int | None]:
    """Tasks the worker reports in ``inspect scheduled`` and ``reserved`` (None: no reply)."""
    inspect = app.control.inspect(timeout=timeout)
    found: dict[str, int | None] = {}
    for what, call in (("scheduled", inspect.scheduled), ("reserved", inspect.reserved)):
        reply = call()
        found[what] = None if not reply else sum(len(tasks or []) for tasks in reply.values())
    return found


def hoard_case(fair: bool, tasks: int, sample_s: float) -> dict[str, Any]:
    queue = KEYED
    with broker() as server:
        client = redis_lib.Redis.from_url(server.url)
        app = producer(server.url, fair, keyed=True)
        w = start(worker(server.url, queue, fair, keyed=True))
        assert w.proc is not None
        pid = w.proc.pid
        try:
            time.sleep(5)  # start-up done: mingle, pool forked
            before = sample_rss(pid, 5)
            memory_before = int(client.info("memory")["used_memory"])
            began = time.monotonic()
            for n in range(tasks):
                app.send_task(
                    "sched.record", args=[n], kwargs={"tenant_id": "t0"},
                    countdown=3600, queue=queue,
                )  # fmt: skip
            publish_s = time.monotonic() - began
            names = KeyedNames(queue)
            if fair:
                settled = poll_until(lambda: store.scheduled(client, names) >= tasks, 60)
            else:
                # The worker fetches every task with an eta at once (Celery raises its
                # prefetch for each): wait until all are in Redis's unacked index.
                settled = poll_until(lambda: client.hlen(UNACKED) >= tasks, 180)
            fetched_s = time.monotonic() - began
            after = sample_rss(pid, sample_s)
            children = tree_rss(pid)[1]
            counts = count_inspect(app, timeout=30)
            memory_after = int(client.info("memory")["used_memory"])
            held_key = names.schedule if fair else UNACKED
            key_bytes = client.memory_usage(held_key, samples=0) or 0
            result = {
                "mode": mode_name(fair),
                "tasks": tasks,
                "publish_s": round(publish_s, 1),
                "settled": settled,
                "settled_after_s": round(fetched_s, 1),
                "in_schedule": store.scheduled(client, names),
                "unacked_index": int(client.hlen(UNACKED)),
                "inspect_scheduled": counts["scheduled"],
                "inspect_reserved": counts["reserved"],
                "rss_before_mib": mib(statistics.median(before)),
                "rss_after_median_mib": mib(statistics.median(after)),
                "rss_after_max_mib": mib(max(after)),
                "rss_growth_mib": mib(statistics.median(after) - statistics.median(before)),
                "rss_samples_after": len(after),
                "pool_processes": children,
                "broker_used_memory_growth_mib": mib(memory_after - memory_before),
                "held_key": "schedule (fair.eta)" if fair else "unacked",
                "held_key_memory_usage_mib": mib(key_bytes),
            }
        finally:
            # Plain Celery: a warm shutdown gives its 20,000 held tasks back to the queue.
            w.stop(timeout=120)
            app.close()
            client.close()
    print(f"hoard {result}", flush=True)
    return result


def hoard(tasks: int, sample_s: float) -> dict[str, Any]:
    return {
        "tasks": tasks,
        "countdown_s": 3600,
        "sample_s": sample_s,
        "cases": [hoard_case(fair, tasks, sample_s) for fair in (True, False)],
    }


def count(n: int | None) -> str:
    return "no reply" if n is None else f"{n:,}"


def hoard_md(data: dict[str, Any]) -> list[str]:
    lines = [
        "## hoard: tasks due in an hour",
        "",
        f"{data['tasks']:,} tasks of one key (keyed queue; plain Celery: the same tasks, "
        "no fair_keys) with `countdown=3600`. RSS: the "
        "worker's main process plus its pool processes, median of 5 samples before "
        f"publishing and of 1/s samples over {data['sample_s']:g} s after (plain Celery: "
        "after the worker fetched them all).",
        "",
        "| mode | held by the worker (`inspect scheduled`) | `inspect reserved` "
        "| in the broker's schedule | in the unacked index | worker RSS before -> after "
        "(MiB) | RSS growth (MiB) | broker `used_memory` growth (MiB) "
        "| `MEMORY USAGE` of what holds them (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cases"]:
        lines.append(
            f"| {c['mode']} | {count(c['inspect_scheduled'])} | {count(c['inspect_reserved'])} | "
            f"{c['in_schedule']:,} | {c['unacked_index']:,} | "
            f"{c['rss_before_mib']} -> {c['rss_after_median_mib']} (max "
            f"{c['rss_after_max_mib']}) | {c['rss_growth_mib']:+} | "
            f"{c['broker_used_memory_growth_mib']} | {c['held_key_memory_usage_mib']} "
            f"({c['held_key']}) |"
        )
    return lines + [""]


# -- ontime -------------------------------------------------------------------------

ONTIME_COUNTDOWN = 3.0
#: A compact Kombu-shaped payload for the bulk-loaded waiting tasks (never due in a run).
FILLER = (
    '{"body":"W1tdLHt9LHt9XQ==","content-encoding":"utf-8","content-type":"application/json",'
    '"headers":{"lang":"py","task":"sched.filler","id":"filler-%d","eta":null},'
    '"properties":{"body_encoding":"base64","delivery_info":{"exchange":"",'
    '"routing_key":"jobs"},"delivery_mode":2,"priority":0,"delivery_tag":"filler-%d"}}'
)


def bulk_schedule(client: Any, names: KeyedNames, count: int, keys: int = 1000) -> float:
    """Fill the queue's schedule with ``count`` envelopes due in an hour (ZADD, pipelined)."""
    began = time.monotonic()
    due = time.time() + 3600
    batch = 10_000
    pipe = client.pipeline(transaction=False)
    for first in range(0, count, batch):
        members: dict[str, float] = {}
        for i in range(first, min(count, first + batch)):
            # The envelope as store.schedule writes it: level, message, key.
            envelope = {"l": "", "m": FILLER % (i, i), "k": f"w{i % keys}"}
            members[json.dumps(envelope, separators=(",", ":"))] = due + i * 1e-4
        pipe.zadd(names.schedule, members)
        if len(pipe) >= 10:
            pipe.execute()
    pipe.execute()
    return time.monotonic() - began


def ontime_case(
    label: str, fair: bool, tasks: int, keys: int, rate: float, waiting: int = 0
) -> dict[str, Any]:
    queue = KEYED
    names = KeyedNames(queue)
    with broker() as server:
        client = redis_lib.Redis.from_url(server.url)
        load_s = bulk_schedule(client, names, waiting) if waiting else 0.0
        memory_loaded = int(client.info("memory")["used_memory"])
        app = producer(server.url, fair, keyed=True)
        w = start(worker(server.url, queue, fair, keyed=True))
        try:
            max_ready, max_held = 0, 0
            began = time.monotonic()
            next_sample = began
            for n in range(tasks):
                target = began + n / rate
                while True:
                    now = time.monotonic()
                    if now >= next_sample:
                        # Ready to fetch (keyed lists + Kombu's list) and held by the worker.
                        pipe = client.pipeline(transaction=False)
                        pipe.hget(names.state, "backlog")
                        pipe.llen(queue)
                        pipe.hlen(UNACKED)
                        backlog, plain_len, held = pipe.execute()
                        if now - began > ONTIME_COUNTDOWN + 0.5:
                            max_ready = max(max_ready, int(backlog or 0) + int(plain_len))
                            max_held = max(max_held, int(held))
                        next_sample = now + 0.25
                    if now >= target:
                        break
                    time.sleep(min(target - now, 0.01))
                app.send_task(
                    "sched.record", args=[n], kwargs={"tenant_id": f"k{n % keys}"},
                    countdown=ONTIME_COUNTDOWN, queue=queue,
                )  # fmt: skip
            send_s = time.monotonic() - began
            done = poll_until(lambda: client.llen("sched.ran") >= tasks, ONTIME_COUNTDOWN + 120)
            records = runs(client)
            left_waiting = store.scheduled(client, names)
            memory_end = int(client.info("memory")["used_memory"])
        finally:
            w.stop()
            app.close()
            client.close()
    late: list[float] = []
    for r in records:
        eta = due_time(r["eta"])
        if eta is not None:
            late.append(float(r["start"]) - eta)
    counts = Counter(r["n"] for r in records)
    result = {
        "case": label,
        "mode": mode_name(fair),
        "tasks": tasks,
        "keys": keys,
        "waiting_in_schedule": waiting,
        "waiting_load_s": round(load_s, 1),
        "broker_used_memory_mib": mib(memory_loaded),
        "broker_used_memory_end_mib": mib(memory_end),
        "send_rate_per_s": round(tasks / send_s, 1) if send_s > 0 else None,
        "all_ran": done,
        "runs": len(records),
        "ran_more_than_once": sum(1 for c in counts.values() if c > 1),
        "left_in_schedule": left_waiting,
        "max_ready_backlog": max_ready,
        "max_unacked": max_held,
        "lateness_p50_s": round(percentile(late, 0.50), 4) if late else None,
        "lateness_p99_s": round(percentile(late, 0.99), 4) if late else None,
        "lateness_max_s": round(max(late), 4) if late else None,
        "lateness_min_s": round(min(late), 4) if late else None,
        "early": sum(1 for x in late if x < 0),
        "worker": f"celery worker -P prefork -c {CONCURRENCY} (Celery's defaults)",
    }
    print(f"ontime {result}", flush=True)
    return result


def ontime(
    tasks: int, rate: float, keys_tasks: int, keys_rate: float, waiting: int
) -> dict[str, Any]:
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("10 keys", lambda: ontime_case("10 keys", True, tasks, 10, rate)),
        (
            "10,000 keys",
            lambda: ontime_case(f"{keys_tasks:,} keys", True, keys_tasks, keys_tasks, keys_rate),
        ),
        (
            "waiting",
            lambda: ontime_case(
                f"10 keys, {waiting:,} waiting", True, tasks, 10, rate, waiting=waiting
            ),
        ),
        ("plain", lambda: ontime_case("10 keys (anchor)", False, tasks, 10, rate)),
    ]
    return {"countdown_s": ONTIME_COUNTDOWN, "cases": [run() for _, run in plan]}


def ontime_md(data: dict[str, Any]) -> list[str]:
    lines = [
        "## ontime: how close to its eta a task starts",
        "",
        f"`countdown={data['countdown_s']:g}`; lateness = start - eta (the task's `eta` "
        "header), seconds. The waiting tasks are bulk-loaded into the same queue's schedule "
        "(`ZADD` of envelopes as `store.schedule` writes them, around small Kombu-shaped "
        "payloads), due in an hour. Ready backlog: the most messages seen waiting to be "
        "fetched, and the most unacknowledged (fetched, held or running), sampled every "
        "0.25 s while sending, once tasks came due.",
        "",
        "| case | mode | tasks | send rate (/s) | p50 | p99 | max | early (< 0) "
        "| max ready backlog | max unacked | ran > once | broker used_memory (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cases"]:
        lines.append(
            f"| {c['case']} | {c['mode']} | {c['runs']:,}/{c['tasks']:,} | "
            f"{c['send_rate_per_s']} | {c['lateness_p50_s']:.3f} | {c['lateness_p99_s']:.3f} | "
            f"{c['lateness_max_s']:.3f} | {c['early']} | {c['max_ready_backlog']} | "
            f"{c['max_unacked']} | "
            f"{c['ran_more_than_once']} | {c['broker_used_memory_mib']} |"
        )
    if data["cases"]:
        lines += ["", f"Worker: {data['cases'][0]['worker']}."]
    return lines + [""]


# -- main ---------------------------------------------------------------------------

SCENARIOS = ("visibility", "hoard", "ontime")


def command(args: argparse.Namespace) -> str:
    """The command line of this run, every option spelled out."""
    return " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--name", default="scheduled")
    parser.add_argument("--hoard-tasks", type=int, default=20_000)
    parser.add_argument("--hoard-sample", type=float, default=40.0)
    parser.add_argument("--ontime-tasks", type=int, default=600)
    parser.add_argument("--ontime-rate", type=float, default=50.0)
    parser.add_argument("--ontime-keys-tasks", type=int, default=10_000)
    parser.add_argument("--ontime-keys-rate", type=float, default=200.0)
    parser.add_argument("--waiting", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    chosen = [s for s in args.scenarios.split(",") if s]
    for s in chosen:
        if s not in SCENARIOS:
            parser.error(f"--scenarios: unknown {s!r}; choose from {', '.join(SCENARIOS)}")
    began = time.monotonic()
    data: dict[str, Any] = {"environment": environment(), "args": vars(args)}
    md = [
        '# Scheduled work on the broker (`fair_eta = "broker"`)',
        "",
        "Real `redis-server` (fresh per case) and the real `celery worker` (prefork, "
        f"concurrency {CONCURRENCY}: Celery's defaults). Method: `bench/scheduled.py`.",
        "",
    ]
    if "visibility" in chosen:
        data["visibility"] = visibility()
        md += visibility_md(data["visibility"])
    if "hoard" in chosen:
        data["hoard"] = hoard(args.hoard_tasks, args.hoard_sample)
        md += hoard_md(data["hoard"])
    if "ontime" in chosen:
        data["ontime"] = ontime(
            args.ontime_tasks, args.ontime_rate, args.ontime_keys_tasks,
            args.ontime_keys_rate, args.waiting,
        )  # fmt: skip
        md += ontime_md(data["ontime"])
    data["seconds"] = round(time.monotonic() - began, 1)
    env = data["environment"]
    md += [
        f"Celery {env['celery']}, Kombu {env['kombu']}, redis-py {env['redis']}, Python "
        f"{env['python']}, {env['cpus']} CPUs; {env['when']}; {data['seconds']:.0f} s.",
        "",
        "    python -m bench.scheduled " + command(args),
        "",
    ]
    write(args.name, data, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
