"""Soak: minutes of mixed load, weight changes and a broker restart, nothing lost.

One real ``celery worker -P prefork -c 2`` with celery-fair consumes three
queues on a real Redis (AOF on, so a restart keeps the data) while a producer
thread keeps every queue backlogged with ``ledger`` tasks of mixed length
(1, 3 or 8 ms, drawn at random).  The run is cut into phases; each phase sets
new weights with the ``fair_weights`` remote-control command, and one phase
restarts Redis on the same port half-way through.  Every task records its id,
queue and start time in a ledger kept on a *second* Redis (which is never
restarted), so the report can say, per phase, the share each queue received
against its target (over the backlogged part of the phase: past a settling
time after the weight change, and without the restart's outage), and, for the
whole run, how many published tasks never ran or ran twice.

    python -m bench.soak [--minutes 4.5] [--name soak] [--plain]
    python -m bench.soak --churn [--tasks 100000] [--reps 1] [--only redis|rabbitmq]

``--plain`` runs the same load and restart with plain Celery (no weights:
its shares are reported, not checked), to compare the lost and duplicate
counts with what Kombu's Redis transport itself gives.

``--churn`` runs the churn soak of :mod:`bench.churn` instead (pool processes
replaced, killed, time-limited and revoked under a backlog, on Redis and on
RabbitMQ, celery-fair and plain Celery in turns): ``bench/results/churn.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis as redis_lib

from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer

from .common import environment, write

QUEUES = ("s1", "s2", "s3")
#: Weights per phase; the restart happens in the phase marked True.
PHASES: tuple[tuple[dict[str, int], bool], ...] = (
    ({"s1": 1, "s2": 2, "s3": 4}, False),
    ({"s1": 4, "s2": 2, "s3": 1}, False),
    ({"s1": 1, "s2": 1, "s3": 2}, True),
    ({"s1": 1, "s2": 3, "s3": 6}, False),
)
TASK_MS = (1, 3, 8)
SETTLE = 3.0  # s after a weight change before a phase is measured
LOW, HIGH = 1000, 2000  # the producer tops a queue up to HIGH when it falls below LOW
VISIBILITY = 10.0  # s: Redis restores the worker's unacknowledged messages after this


@dataclass
class Producer:
    """Keeps every queue backlogged; records each published id and queue.

    Messages are Celery's own (one template per queue and task length, made
    by ``send_task``), copied with fresh ids and pushed in one pipeline per
    top-up: fast enough that a queue never drains while being refilled.
    """

    url: str
    published: dict[str, str] = field(default_factory=dict)
    #: Ids of a pipeline that failed (the broker restarting): may or may not exist.
    uncertain: set[str] = field(default_factory=set)
    errors: int = 0
    lengths: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)

    def templates(self) -> dict[tuple[str, int], dict[str, Any]]:
        from celery import Celery

        app = Celery("soak-producer", broker=self.url, set_as_current=False)
        client = redis_lib.Redis.from_url(self.url)
        out = {}
        try:
            for q in QUEUES:
                for ms in TASK_MS:
                    scratch = f"soak-template-{uuid.uuid4().hex}"
                    app.send_task("ledger", args=(ms,), queue=scratch)
                    raw = client.rpop(scratch)
                    client.delete(scratch)
                    message = json.loads(raw)  # type: ignore[arg-type]
                    message["properties"]["delivery_info"] = {"exchange": "", "routing_key": q}
                    out[(q, ms)] = message
        finally:
            app.close()
        return out

    def run(self) -> None:
        rng = random.Random(7)
        templates = self.templates()
        client = redis_lib.Redis.from_url(self.url, socket_timeout=2)
        while not self.stop.is_set():
            batch: dict[str, str] = {}
            try:
                now = time.time()
                lengths = {q: int(client.llen(q)) for q in QUEUES}  # type: ignore[arg-type]
                for q, n in lengths.items():
                    self.lengths.setdefault(q, []).append((now, n))
                pipe = client.pipeline(transaction=False)
                for q, n in lengths.items():
                    for _ in range(HIGH - n if n < LOW else 0):
                        message = templates[(q, rng.choice(TASK_MS))]
                        tid = str(uuid.uuid4())
                        message["headers"]["id"] = message["headers"]["root_id"] = tid
                        message["properties"]["correlation_id"] = tid
                        message["properties"]["delivery_tag"] = str(uuid.uuid4())
                        pipe.lpush(q, json.dumps(message))
                        batch[tid] = q
                pipe.execute()
                self.published.update(batch)
                self.ready.set()
            except redis_lib.RedisError:  # the broker restarts: try again shortly
                self.errors += 1
                self.uncertain.update(batch)
                client = redis_lib.Redis.from_url(self.url, socket_timeout=2)
                time.sleep(0.2)
            self.stop.wait(0.05)


def locate(url: str, ids: set[str]) -> dict[str, list[str]]:
    """Where tasks that never ran are: a queue, Kombu's unacked index, or nowhere."""
    client = redis_lib.Redis.from_url(url)
    found: dict[str, list[str]] = {"queued": [], "unacked": [], "nowhere": []}
    queued = {
        json.loads(raw)["headers"]["id"]
        for q in QUEUES
        for raw in client.lrange(q, 0, -1)  # type: ignore[union-attr]
    }
    unacked = {
        json.loads(raw)[0]["headers"]["id"]
        for raw in client.hvals("unacked")  # type: ignore[union-attr]
    }
    for tid in sorted(ids):
        key = "queued" if tid in queued else "unacked" if tid in unacked else "nowhere"
        found[key].append(tid)
    return found


def read_ledger(client: redis_lib.Redis, start: int) -> list[dict[str, Any]]:
    return [json.loads(e) for e in client.lrange("ledger", start, -1)]  # type: ignore[union-attr]


def set_weights(url: str, weights: dict[str, int]) -> None:
    """Broadcast ``fair_weights`` until the worker acknowledges it."""
    from celery import Celery

    arg = [f"{q}={w}" for q, w in weights.items()]
    deadline = time.monotonic() + 60
    replies: Any = None
    while time.monotonic() < deadline:
        app = Celery("soak-control", broker=url, set_as_current=False)
        try:
            replies = app.control.broadcast(
                "fair_weights", arguments={"weights": arg}, reply=True, timeout=3, limit=1
            )
            if replies and "ok" in next(iter(replies[0].values())):
                return
        except Exception as exc:  # noqa: BLE001 - a connection from before a restart
            replies = exc
            time.sleep(0.5)
        finally:
            app.close()
    raise RuntimeError(f"fair_weights {arg} not acknowledged: {replies!r}")


def shares(entries: list[dict[str, Any]], t0: float, t1: float, gap: tuple[float, float]) -> dict:
    counts = Counter(
        e["queue"]
        for e in entries
        if t0 <= e["started"] < t1 and not gap[0] <= e["started"] < gap[1]
    )
    total = sum(counts.values()) or 1
    return {"counts": {q: counts.get(q, 0) for q in QUEUES},
            "shares": {q: counts.get(q, 0) / total for q in QUEUES}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.5, help="length of the load phases")
    parser.add_argument("--name", default=None, help="result file name in bench/results/")
    parser.add_argument("--plain", action="store_true", help="plain Celery, for comparison")
    parser.add_argument("--churn", action="store_true", help="the churn soak (bench.churn)")
    parser.add_argument("--tasks", type=int, default=100_000, help="--churn: tasks per run")
    parser.add_argument("--reps", type=int, default=1, help="--churn: repetitions per variant")
    parser.add_argument("--only", choices=("redis", "rabbitmq"), help="--churn: one broker")
    parser.add_argument(
        "--resources",
        action="store_true",
        help="--churn: capacities, a queue limit and declared resources",
    )
    parser.add_argument(
        "--priorities",
        action="store_true",
        help="--churn: tasks with priorities, the levels weighted (fair_priority='weighted')",
    )
    args = parser.parse_args(argv)
    if args.churn:
        from . import churn

        command = " ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)])
        return churn.main(
            args.tasks,
            args.reps,
            args.only,
            args.name or "churn",
            command,
            args.resources,
            args.priorities,
        )
    name = args.name or ("soak_plain" if args.plain else "soak")
    phase_s = args.minutes * 60 / len(PHASES)
    if phase_s < 4 * SETTLE:
        parser.error(f"--minutes {args.minutes} leaves phases of {phase_s:.1f} s: too short")
    started_at = time.time()
    with RedisServer(appendonly=True) as broker, RedisServer() as ledger_server:
        ledger = redis_lib.Redis.from_url(ledger_server.url)
        producer = Producer(broker.url)
        thread = threading.Thread(target=producer.run, name="soak-producer", daemon=True)
        thread.start()
        if not producer.ready.wait(60):
            raise RuntimeError("the producer did not fill the queues")
        first = PHASES[0][0]
        env = {"CELERY_FAIR_LEDGER": ledger_server.url, "CELERY_FAIR_VISIBILITY": str(VISIBILITY)}
        worker = WorkerProcess(
            broker.url,
            list(QUEUES),
            concurrency=2,
            env=env,
            fair=not args.plain,
            extra_args=[]
            if args.plain
            else ["--fair-weights", ",".join(f"{q}={w}" for q, w in first.items())],
        )
        entries: list[dict[str, Any]] = []
        phases: list[dict[str, Any]] = []
        restart: dict[str, float] = {}
        with worker:
            deadline = time.monotonic() + 60
            while ledger.llen("ledger") < 50:
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
                assert time.monotonic() < deadline, "the worker did not start consuming"
                time.sleep(0.1)
            for index, (weights, with_restart) in enumerate(PHASES):
                if index and not args.plain:
                    set_weights(broker.url, weights)
                t0 = time.time()
                note = " (broker restart half-way)" if with_restart else ""
                print(f"phase {index + 1}: weights {weights}{note}", flush=True)
                restarted = False
                last_print = t0
                while time.time() < t0 + phase_s:
                    assert worker.proc is not None and worker.proc.poll() is None, worker.log()[
                        -3000:
                    ]
                    time.sleep(0.5)
                    now = time.time()
                    if with_restart and not restarted and now >= t0 + phase_s / 2:
                        entries += read_ledger(ledger, len(entries))
                        restart["at"] = time.time()
                        print("  restarting the broker (same port, AOF data kept)", flush=True)
                        broker.restart()
                        restart["up"] = time.time()
                        restarted = True
                    if now - last_print >= 10:
                        entries += read_ledger(ledger, len(entries))
                        window = shares(entries, now - 10, now, (0, 0))
                        done = sum(window["counts"].values())
                        print(
                            f"  {now - started_at:6.0f} s  ran {len(entries):7d}  "
                            f"last 10 s: {done / 10:5.0f}/s  shares "
                            + " ".join(f"{q} {s:5.1%}" for q, s in window["shares"].items()),
                            flush=True,
                        )
                        last_print = now
                phases.append({"weights": weights, "start": t0, "end": time.time(),
                               "restart": with_restart})  # fmt: skip
            producer.stop.set()
            thread.join(timeout=30)
            print(f"draining: {len(producer.published)} published", flush=True)
            deadline = time.monotonic() + 120 + VISIBILITY
            published = set(producer.published)
            client = redis_lib.Redis.from_url(broker.url)
            idle_since = time.monotonic()
            while time.monotonic() < deadline:
                count = len(entries)
                entries += read_ledger(ledger, count)
                if published <= {e["id"] for e in entries}:
                    break
                if len(entries) > count:
                    idle_since = time.monotonic()
                # Nothing left anywhere in Redis and nothing running: the rest is lost.
                left = sum(int(client.llen(q)) for q in QUEUES) + int(client.hlen("unacked"))  # type: ignore[arg-type]
                if not left and time.monotonic() - idle_since > 5:
                    break
                time.sleep(0.5)
            time.sleep(2)  # a duplicate may still be running
            entries += read_ledger(ledger, len(entries))
            stats_log = worker.log()
        where = locate(broker.url, set(producer.published) - {e["id"] for e in entries})
    ran = Counter(e["id"] for e in entries)
    lost = [tid for tid in producer.published if tid not in ran]
    duplicates = sum(n - 1 for n in ran.values() if n > 1)
    unexpected = [
        tid for tid in ran if tid not in producer.published and tid not in producer.uncertain
    ]
    gap = (restart.get("at", 0.0), 0.0)
    if restart:
        after = sorted(e["started"] for e in entries if e["started"] > restart["up"])
        resumed = after[0] if after else restart["up"]
        # The outage, and the visibility timeout that brings back what the
        # worker held when the broker went down, are not a backlogged period.
        gap = (restart["at"], max(resumed, restart["at"]) + VISIBILITY + SETTLE)
        restart["resumed"] = resumed
    results_phases = []
    worst = 0.0
    for index, phase in enumerate(phases):
        measured = shares(entries, phase["start"] + SETTLE, phase["end"],
                          gap if phase["restart"] else (0.0, 0.0))  # fmt: skip
        total_w = sum(phase["weights"].values())
        target = {q: w / total_w for q, w in phase["weights"].items()}
        deviation = {q: measured["shares"][q] - target[q] for q in QUEUES}
        worst = max(worst, *(abs(d) for d in deviation.values()))
        lows = {
            q: min(
                (n for t, n in producer.lengths.get(q, []) if phase["start"] + SETTLE <= t
                 < phase["end"] and not (phase["restart"] and gap[0] <= t < gap[1])),
                default=None,
            )
            for q in QUEUES
        }  # fmt: skip
        results_phases.append({
            "phase": index + 1, "weights": phase["weights"], "target": target,
            "measured": measured["shares"], "counts": measured["counts"],
            "deviation": deviation, "seconds": phase["end"] - phase["start"],
            "restart": phase["restart"], "min_queue_length": lows,
        })  # fmt: skip
    timeline: dict[int, Counter[str]] = {}
    for e in entries:
        timeline.setdefault(int((e["started"] - started_at) // 5) * 5, Counter())[e["queue"]] += 1
    results: dict[str, Any] = {
        "env": environment(),
        "timeline_5s": {t: dict(c) for t, c in sorted(timeline.items())},
        "phase_bounds": [(p["start"] - started_at, p["end"] - started_at) for p in phases],
        "params": {
            "minutes": args.minutes,
            "phase_seconds": phase_s,
            "settle": SETTLE,
            "task_ms": TASK_MS,
            "visibility_timeout": VISIBILITY,
            "pool": "prefork",
            "concurrency": 2,
        },  # fmt: skip
        "phases": results_phases,
        "published": len(producer.published),
        "ran": len(ran),
        "lost": len(lost),
        "duplicates": duplicates,
        "unexpected": len(unexpected),
        "lost_where": where,
        "publish_errors": producer.errors,
        "uncertain_publishes": len(producer.uncertain),
        "uncertain_ran": sum(1 for tid in producer.uncertain if tid in ran),
        "restart": restart,
        "worst_deviation": worst,
        "shares_hold": worst <= 0.05,
        "plain": args.plain,
        "worker_alive_to_the_end": "Unrecoverable error" not in stats_log,
    }
    lines = [
        "# Soak: weight changes and a broker restart under mixed load"
        + (" (plain Celery)" if args.plain else ""),
        "",
        f"Reproduce: `python -m bench.soak --minutes {args.minutes:g}"
        f"{' --plain' if args.plain else ''}` "
        f"({results['env']['when']}; one `celery worker -P prefork -c 2` with "
        f"{'plain Celery (weights not applied)' if args.plain else 'celery-fair'} on "
        f"Redis, queues {', '.join(QUEUES)} kept backlogged with `ledger` tasks of "
        f"{'/'.join(map(str, TASK_MS))} ms at random; "
        + (
            "the targets are what weights would give"
            if args.plain
            else "weights changed with `control fair_weights` at each phase"
        )
        + "; Redis restarted on the same port in phase 3). "
        f"Shares are counts of tasks started from {SETTLE:g} s after the weight change to the "
        f"end of the phase; in the restart phase the outage plus the {VISIBILITY:g} s "
        f"visibility timeout is left out.",
        "",
        "| phase | weights | target | measured | worst deviation | tasks | min queue length |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in results_phases:
        target = " / ".join(f"{p['target'][q]:.1%}" for q in QUEUES)
        measured = " / ".join(f"{p['measured'][q]:.1%}" for q in QUEUES)
        lows = ", ".join(f"{q} {n}" for q, n in p["min_queue_length"].items())
        lines.append(
            f"| {p['phase']}{' (restart)' if p['restart'] else ''} "
            f"| {':'.join(str(p['weights'][q]) for q in QUEUES)} | {target} | {measured} "
            f"| {max(abs(d) for d in p['deviation'].values()):.1%} "
            f"| {sum(p['counts'].values())} | {lows} |"
        )
    outage = (
        f"{restart['resumed'] - restart['at']:.1f} s from the restart to the first task "
        f"started after the broker was up again"
        if restart
        else "no restart"
    )
    lines += [
        "",
        f"Published {results['published']}, ran {results['ran']}: **lost {results['lost']}**, "
        f"duplicates {results['duplicates']}, unexpected {results['unexpected']} "
        f"(publish attempts that failed during the outage: {results['publish_errors']}). "
        f"Broker restart: {outage}. Worst share deviation {worst:.1%} "
        f"({'within' if results['shares_hold'] else 'OUTSIDE'} +-5%).",
    ]
    if lost:
        lines += [
            "",
            f"Where the lost tasks are: {len(where['queued'])} still queued, "
            f"{len(where['unacked'])} in Kombu's unacknowledged index (not restored), "
            f"{len(where['nowhere'])} nowhere in Redis (taken by BRPOP but never recorded as "
            "unacknowledged: the broker went down between the two commands).",
        ]
    write(name, results, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if (results["shares_hold"] or args.plain) and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
