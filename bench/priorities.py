"""Priorities with fairness keys on Redis: urgent waits under a batch backlog, and fetch cost.

Four experiments, the first two against plain Celery in the same run, alternating, ``--reps`` times:

* **waits**: one queue, ``celery worker -P prefork -c 2``.  Batch work at priority 9
  (the last level on Redis): 20 tenants, three of them weighted 1:2:4, with backlogs
  of 150 tasks per unit of weight, and a flood tenant with 1,500; tasks of 2 ms.
  Urgent work at priority 0 from 5 tenants at a low rate (``--urgent-rate``) for
  ``--seconds``.  The urgent tasks' publish -> start wait, p50 and p99, alone on the
  worker (unloaded) and while the batch level is backlogged (loaded); the shares of
  the three weighted batch tenants while all three are backlogged.  Plain Celery
  runs the same messages on one queue with Kombu's priority lists.
* **weighted levels**: two backlogged levels, ``fair_priority="weighted"`` at 4:1,
  the share of the first (plain Celery: Kombu's strict order);
* **throughput**: the worker's tasks/s on a keyed queue of no-op tasks over 10 or
  10,000 keys, every message at priority 9 (priorities on) or without one (off);
* **fetch cost**: the fetch script alone, microseconds per call, with the messages
  in the first level (priorities off: what a queue without priorities costs) or in
  the last (priorities on, strict: three empty levels looked at first), at 10 and
  10,000 keys; and ``fair_priority="weighted"``.

    python -m bench.priorities [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from typing import Any

from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from celery_fair.keys.scripts import ENQUEUE, FETCH
from celery_fair.keys.store import enqueue_args, fetch_args
from tests.harness.harness import WorkerProcess
from tests.harness.keys import fetchable_payload, keyed_app, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE = "jobs"
SEP = "\x06\x16"
LEVELS = [f"{SEP}3", f"{SEP}6", f"{SEP}9"]
WEIGHTED = {"b00": 1, "b01": 2, "b02": 4}
BATCH = {**{f"b{i:02d}": 150 * WEIGHTED.get(f"b{i:02d}", 1) for i in range(20)}, "flood": 1500}
URGENT = [f"u{i}" for i in range(5)]


def _producer(url: str, keyed: bool) -> Any:
    if keyed:
        return keyed_app(url, {QUEUE: "tenant_id"}, "priorities-producer")
    app = Celery("priorities-producer", broker=url, set_as_current=False)
    celery_fair.install(app)  # stamps the publish time only: plain Celery otherwise
    return app


def _worker(url: str, keyed: bool, **extra: str) -> WorkerProcess:
    env = {"CELERY_FAIR_LEDGER": url, "CELERY_FAIR_MAX_PRIORITY": "10", **extra}
    if keyed:
        env["CELERY_FAIR_KEYS"] = f"{QUEUE}=tenant_id"
        env["CELERY_FAIR_KEY_WEIGHTS"] = ",".join(f"{k}={w}" for k, w in WEIGHTED.items())
    return WorkerProcess(url, [QUEUE], concurrency=2, fair=keyed, env=env)


def _urgent_stream(app: Any, rate: float, seconds: float) -> int:
    """Publish urgent tasks (priority 0) at ``rate`` per second, the tenants in turn."""
    n = int(rate * seconds)
    start = time.monotonic()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the producer, not waiting for a result
            app.send_task(
                "ledger", kwargs={"ms": 2, "tenant_id": URGENT[i % len(URGENT)]},
                queue=QUEUE, producer=producer, priority=0,
            )  # fmt: skip
    return n


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def waits_run(keyed: bool, rate: float, seconds: float) -> dict[str, Any]:
    """Urgent waits unloaded then loaded, and the weighted batch tenants' shares."""
    out: dict[str, Any] = {}
    for phase in ("unloaded", "loaded"):
        with RedisServer() as server:
            app = _producer(server.url, keyed)
            ledger = Ledger(server.url)
            batch = sum(BATCH.values()) if phase == "loaded" else 0
            if batch:
                publish_by_key(app, QUEUE, BATCH, ms=2, priority=9)
            with _worker(server.url, keyed) as worker:
                if batch:  # the worker is busy with the batch before urgent work comes
                    assert ledger.wait_for(300, timeout=120, alive=[worker]), worker.log()[-2000:]
                else:  # the worker is up (its start-up is not a wait)
                    publish_by_key(app, QUEUE, {"warm-up": 5}, ms=0, priority=0)
                    assert ledger.wait_for(5, timeout=120, alive=[worker]), worker.log()[-2000:]
                sent = _urgent_stream(app, rate, seconds)
                deadline = time.monotonic() + 120
                while _urgent_ran(ledger) < sent:
                    assert time.monotonic() < deadline, "urgent tasks did not all run"
                    assert worker.proc is not None and worker.proc.poll() is None
                    time.sleep(0.1)  # polled with a deadline
                # The batch level must still hold work: backlogged throughout.
                backlog = _batch_left(server.url, keyed)
            app.close()
            entries = sorted(ledger.entries(), key=lambda e: e.started)
        waits = [e.wait * 1000 for e in entries if e.tenant in URGENT and e.wait is not None]
        out[phase] = {
            "urgent": len(waits),
            "p50_ms": _percentile(waits, 0.50),
            "p99_ms": _percentile(waits, 0.99),
            "batch_left_when_urgent_done": backlog,
        }
        if batch:
            out["shares"] = _shares(entries)
    return out


def levels_run(keyed: bool) -> float:
    """Share of priority 0 among the tasks run while both levels had a backlog.

    celery-fair: ``fair_priority="weighted"`` with 4:1 between priorities 0 and 9
    (target 80%); plain Celery: Kombu's strict order.
    """
    with RedisServer() as server:
        app = _producer(server.url, keyed)
        publish_by_key(app, QUEUE, {"hi-a": 600, "hi-b": 600}, ms=2, priority=0)
        publish_by_key(app, QUEUE, {"lo-a": 600, "lo-b": 600}, ms=2, priority=9)
        app.close()
        ledger = Ledger(server.url)
        extra = (
            {"CELERY_FAIR_PRIORITY": "weighted", "CELERY_FAIR_PRIORITY_WEIGHTS": "0=4,9=1"}
            if keyed
            else {}
        )
        with _worker(server.url, keyed, **extra) as worker:
            assert ledger.wait_for(1100, timeout=300, alive=[worker]), worker.log()[-2000:]
        entries = sorted(ledger.entries(), key=lambda e: e.started)
    # Tasks 100 to 1,000: past the start, and fewer than either level's 1,200.
    window = [e.tenant or "" for e in entries[100:1000]]
    return sum(t.startswith("hi-") for t in window) / len(window)


def _urgent_ran(ledger: Ledger) -> int:
    return sum(1 for e in ledger.entries() if e.tenant in URGENT)


def _batch_left(url: str, keyed: bool) -> int:
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    if keyed:
        return int(client.hget(KeyedNames(QUEUE).state, "backlog") or 0)
    return int(sum(client.llen(QUEUE + s) for s in ["", *LEVELS]))


def _shares(entries: list[Any]) -> dict[str, float]:
    """Shares of b00, b01, b02 among themselves while all three had work."""
    last = {k: max(e.started for e in entries if e.tenant == k) for k in WEIGHTED}
    end = min(last.values())
    counts = Counter(e.tenant for e in entries if e.tenant in WEIGHTED and e.started < end)
    total = sum(counts.values()) or 1
    return {k: counts[k] / total for k in WEIGHTED}


def throughput_run(keys: int, on: bool, tasks: int) -> float:
    """Worker tasks/s on a keyed queue backlogged over ``keys`` keys, no-op tasks.

    ``on``: every message at priority 9 (the last level: the fetch looks at three
    empty levels first); off: without a priority (the first level).
    """
    per_key = max(1, tasks // keys)
    with RedisServer() as server:
        app = _producer(server.url, True)
        publish_by_key(
            app, QUEUE, {f"t{i}": per_key for i in range(keys)}, ms=0, priority=9 if on else None
        )
        app.close()
        ledger = Ledger(server.url)
        total = per_key * keys
        with _worker(server.url, True) as worker:
            assert ledger.wait_for(total, timeout=300, alive=[worker]), worker.log()[-2000:]
        started = sorted(e.started for e in ledger.entries())
    window = started[total // 10 : total - total // 10]  # backlogged: no start-up, no tail
    return (len(window) - 1) / (window[-1] - window[0])


def fetch_cost(url: str, keys: int, mode: str, calls: int = 2000) -> float:
    """Microseconds per fetch script call; ``mode``: off, strict or weighted."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    client.flushall()
    names = KeyedNames(QUEUE)
    level = "" if mode == "off" else LEVELS[-1]
    per_key = max(1, (calls + keys) // keys + 1)
    pipe = client.pipeline(transaction=False)
    for k in range(keys):
        for _ in range(per_key):
            pipe.evalsha(
                ENQUEUE.sha,
                0,
                *enqueue_args(names, f"t{k}", fetchable_payload(f"t{k}", QUEUE), level=level),
            )
        if k % 500 == 499:
            pipe.execute()
    client.script_load(ENQUEUE.text)
    pipe.execute()
    sha = client.script_load(FETCH.text)
    weights: list[Any] = []
    if mode == "weighted":
        for suffix, weight in zip(["", *LEVELS], (8, 4, 2, 1), strict=True):
            weights += [suffix, repr(float(weight))]
    args = fetch_args(["1.0"], sep=SEP, now=0.0, suffixes=LEVELS, level_words=weights)
    keys_arg = [QUEUE, QUEUE + ".fair-malformed", "unacked", "unacked_index"]
    started = time.perf_counter()
    for _ in range(calls):
        assert client.evalsha(sha, 4, *keys_arg, *args) is not None
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--urgent-rate", type=float, default=20.0, help="urgent tasks per second")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long urgent work comes")
    parser.add_argument("--tasks", type=int, default=10_000, help="no-op tasks per throughput run")
    parser.add_argument("--name", default="priorities")
    args = parser.parse_args(argv)
    waits: dict[str, list[dict[str, Any]]] = {"plain": [], "fair": []}
    costs: dict[str, list[float]] = {}
    throughput: dict[str, list[float]] = {}
    levels: dict[str, list[float]] = {"plain": [], "fair": []}
    for rep in range(args.reps):
        order = ("plain", "fair") if rep % 2 == 0 else ("fair", "plain")
        for mode in order:
            res = waits_run(mode == "fair", args.urgent_rate, args.seconds)
            waits[mode].append(res)
            print(
                f"rep {rep + 1} {mode:5} urgent p99 unloaded {res['unloaded']['p99_ms']:.1f} ms, "
                f"loaded {res['loaded']['p99_ms']:.1f} ms; shares {res.get('shares')}",
                flush=True,
            )
        for mode in order:
            share = levels_run(mode == "fair")
            levels[mode].append(share)
            print(f"rep {rep + 1} {mode:5} levels: priority 0 served {share:.1%}", flush=True)
        for keys in (10, 10_000):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                rate = throughput_run(keys, on, args.tasks)
                label = "on" if on else "off"
                throughput.setdefault(f"{keys}/{label}", []).append(rate)
                print(
                    f"rep {rep + 1} throughput {keys} keys {label:3} {rate:.0f} tasks/s", flush=True
                )
        with RedisServer() as server:
            for keys in (10, 10_000):
                cells = ("off", "strict", "weighted")
                for mode in cells if rep % 2 == 0 else tuple(reversed(cells)):
                    us = fetch_cost(server.url, keys, mode)
                    costs.setdefault(f"{keys}/{mode}", []).append(us)
                    print(f"rep {rep + 1} fetch {keys} keys {mode:8} {us:.0f} us", flush=True)
    results = {
        "env": environment(),
        "args": vars(args),
        "waits": waits,
        "costs": costs,
        "throughput": throughput,
        "levels": levels,
    }
    write(args.name, results, _markdown(results))
    return 0


def _markdown(results: dict[str, Any]) -> str:
    env, a = results["env"], results["args"]
    lines = [
        "# Priorities with fairness keys (Redis)",
        "",
        f"Reproduce: `python -m bench.priorities --reps {a['reps']}` ({env['when']}, celery "
        f"{env['celery']}, kombu {env['kombu']}, {env['cpus']} CPUs). `celery worker -P prefork "
        "-c 2` with Celery's defaults on a real Redis; plain Celery and celery-fair alternate. "
        f"Urgent work: priority 0, {a['urgent_rate']:g} tasks/s from 5 tenants for "
        f"{a['seconds']:g} s; batch: priority 9, 20 tenants and a flood tenant "
        f"({sum(BATCH.values())} tasks of 2 ms), backlogged throughout.",
        "",
        "| mode | urgent p50 unloaded | p99 unloaded | p50 loaded | p99 loaded "
        "| p99 loaded / unloaded |",
        "|---|---|---|---|---|---|",
    ]
    for mode, reps in results["waits"].items():
        med = {
            f"{ph}_{m}": statistics.median(r[ph][f"{m}_ms"] for r in reps)
            for ph in ("unloaded", "loaded")
            for m in ("p50", "p99")
        }
        ratios = summary([r["loaded"]["p99_ms"] / r["unloaded"]["p99_ms"] for r in reps])
        lines.append(
            f"| {mode} | {med['unloaded_p50']:.1f} ms | {med['unloaded_p99']:.1f} ms "
            f"| {med['loaded_p50']:.1f} ms | {med['loaded_p99']:.1f} ms "
            f"| {ratios['median']:.2f} [{ratios['min']:.2f}, {ratios['max']:.2f}] |"
        )
    lines += [
        "",
        "Batch tenants weighted 1:2:4 (celery-fair), shares among the three while all had "
        "work, median [min, max]:",
        "",
        "| tenant | weight | target | plain Celery | celery-fair |",
        "|---|---|---|---|---|",
    ]
    total = sum(WEIGHTED.values())
    for key, weight in WEIGHTED.items():
        cells = []
        for mode in ("plain", "fair"):
            s = summary([r["shares"][key] for r in results["waits"][mode]])
            cells.append(f"{s['median']:.1%} [{s['min']:.1%}, {s['max']:.1%}]")
        lines.append(f"| {key} | {weight} | {weight / total:.1%} | {cells[0]} | {cells[1]} |")
    lv = {m: summary(results["levels"][m]) for m in ("plain", "fair")}
    lines += [
        "",
        "Two backlogged levels (priority 0 and 9, two keys each, 1,200 tasks of 2 ms each): "
        "the share of priority 0 among tasks 100 to 1,000. celery-fair with "
        '`fair_priority="weighted"` and `fair_priority_weights="0=4,9=1"` (target 80%); '
        "plain Celery serves Kombu's priority lists strictly. Median [min, max]:",
        "",
        "| plain Celery | celery-fair weighted 4:1 | target |",
        "|---|---|---|",
        f"| {lv['plain']['median']:.1%} [{lv['plain']['min']:.1%}, {lv['plain']['max']:.1%}] "
        f"| {lv['fair']['median']:.1%} [{lv['fair']['min']:.1%}, {lv['fair']['max']:.1%}] "
        "| 80.0% |",
    ]
    lines += [
        "",
        "The fetch script alone, microseconds per call (one keyed queue, Kombu's four "
        "priority steps; off: messages in the first level; strict: in the last, three "
        "empty levels first; weighted: 8:4:2:1), median [min, max]:",
        "",
        "| keys | off | strict | weighted | strict / off |",
        "|---|---|---|---|---|",
    ]
    costs = results["costs"]
    for keys in (10, 10_000):
        c = {m: summary(costs[f"{keys}/{m}"]) for m in ("off", "strict", "weighted")}
        row = " | ".join(
            f"{c[m]['median']:.0f} [{c[m]['min']:.0f}, {c[m]['max']:.0f}]"
            for m in ("off", "strict", "weighted")
        )
        ratio = c["strict"]["median"] / c["off"]["median"]
        lines.append(f"| {keys:,} | {row} | {ratio:.2f} |")
    lines += [
        "",
        f"Worker throughput, celery-fair, no-op tasks ({a['tasks']:,} per run, the middle "
        "80% measured), all messages at priority 9 (on: three empty levels looked at "
        "before each fetch's level) or without a priority (off), median [min, max]:",
        "",
        "| keys | off, tasks/s | on, tasks/s | on / off |",
        "|---|---|---|---|",
    ]
    for keys in (10, 10_000):
        t = {m: summary(results["throughput"][f"{keys}/{m}"]) for m in ("off", "on")}
        lines.append(
            f"| {keys:,} | {t['off']['median']:.0f} [{t['off']['min']:.0f}, {t['off']['max']:.0f}] "
            f"| {t['on']['median']:.0f} [{t['on']['min']:.0f}, {t['on']['max']:.0f}] "
            f"| {t['on']['median'] / t['off']['median']:.1%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
