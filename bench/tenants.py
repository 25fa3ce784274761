"""Tenant controls on Redis: two-level shares, a flooding user, and the cost of two levels.

Four experiments, alternating their modes, ``--reps`` times, ``celery worker -P
prefork -c 2`` with Celery's defaults on a real Redis:

* **shares**: two tenants 1:1, t1's users weighted 1:3 (``"t1/u3": 3``), 600 tasks
  of 2 ms per user, interleaved: the shares of the tenants, and of t1's users
  within t1, while all are backlogged.  Modes: plain Celery (one FIFO queue),
  one-level keys (tenant only) and two-level keys.
* **flood**: one user of tenant t1 floods (``--flood`` tasks of 2 ms); four other
  users of t1 and four other tenants send ``--rate`` tasks/s in all, for
  ``--seconds``.  Their publish -> start waits, p50 and p99, with the flood
  (loaded) and without (unloaded); the flood lasts past the measurement.
* **fetch cost**: the fetch script alone, microseconds per call, with ``K`` keys
  waiting: one level (``K`` keys) or two (``K / 10`` tenants of 10 users each),
  for ``K`` = 10, 10,000 and 1,000,000.
* **pause**: two workers, keys a and b with 300 tasks of 20 ms each; a is paused
  (``control fair_key_pause``) after 40 tasks ran, and resumed once b is done: a's
  tasks that started after the pause reply, how late the last one did, the order of
  a's waiting messages while paused, and tasks lost or run twice.  (Plain Celery
  has no pause to compare with.)
* **cap**: ``--producers`` threads publish to a key capped at ``--cap``, each
  ``--per-producer`` tasks, first with no worker (the refusals must be exactly the
  excess), then with a worker consuming meanwhile (a sampler reads the key's
  backlog throughout: never above the cap; every accepted task runs once).
* **throughput**: the worker's tasks/s on no-op tasks with the same ``K`` keys,
  one level against two.  ``--tasks`` real tasks; past that many keys, the other
  keys wait with a small payload the measurement never reaches (their start
  tags are set far ahead), so that the line of keys really has ``K``.

    python -m bench.tenants [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from celery_fair.keys.scripts import ENQUEUE, FETCH
from celery_fair.keys.store import enqueue_args
from tests.harness.harness import WorkerProcess
from tests.harness.keys import fetchable_payload, keyed_app
from tests.harness.ledger import Ledger, percentile
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE = "jobs"
SEP = "\x06\x16"
ONE, TWO = f"{QUEUE}=tenant_id", f"{QUEUE}=tenant_id+user_id"
MODES = ("plain", "one", "two")
SIZES = (10, 10_000, 1_000_000)
QUIET_T1 = [f"q{i}" for i in range(4)]
OTHERS = [f"t{i}" for i in range(2, 6)]


def _producer(url: str, mode: str) -> Any:
    if mode == "plain":
        app = Celery("tenants-producer", broker=url, set_as_current=False)
        celery_fair.install(app)  # stamps the publish time only: plain Celery otherwise
        return app
    spec = ("tenant_id", "user_id") if mode == "two" else "tenant_id"
    return keyed_app(url, {QUEUE: spec}, "tenants-producer")


def _worker(url: str, mode: str, **extra: str) -> WorkerProcess:
    env = {"CELERY_FAIR_LEDGER": url, **extra}
    if mode != "plain":
        env["CELERY_FAIR_KEYS"] = TWO if mode == "two" else ONE
    return WorkerProcess(url, [QUEUE], concurrency=2, fair=mode != "plain", env=env)


def _send(app: Any, tasks: list[tuple[str, str]], ms: float) -> None:
    with app.producer_or_acquire() as producer:
        for tenant, user in tasks:
            app.send_task(
                "ledger", kwargs={"ms": ms, "tenant_id": tenant, "user_id": user},
                queue=QUEUE, producer=producer,
            )  # fmt: skip


def shares_run(mode: str, per_user: int) -> dict[str, float]:
    """Tenant shares and t1's users' shares within t1 while every user had work."""
    with RedisServer() as server:
        app = _producer(server.url, mode)
        _send(app, [t for _ in range(per_user) for t in (("t1", "u1"), ("t1", "u3"), ("t2", "v"))],
              ms=2)  # fmt: skip
        app.close()
        ledger = Ledger(server.url)
        extra = {"CELERY_FAIR_KEY_WEIGHTS": "t1/u3=3"} if mode != "plain" else {}
        total = 3 * per_user
        with _worker(server.url, mode, **extra) as worker:
            assert ledger.wait_for(total, timeout=600, alive=[worker]), worker.log()[-2000:]
        entries = sorted(ledger.entries(), key=lambda e: e.started)
    users = {("t1", "u1"), ("t1", "u3"), ("t2", "v")}
    end = min(max(e.started for e in entries if (e.tenant, e.user) == u) for u in users)
    window = [e for e in entries[50:] if e.started < end]  # every user backlogged
    tenants = Counter(e.tenant for e in window)
    t1 = Counter(e.user for e in window if e.tenant == "t1")
    return {
        "t1": tenants["t1"] / len(window),
        "t2": tenants["t2"] / len(window),
        "u1_in_t1": t1["u1"] / sum(t1.values()),
        "u3_in_t1": t1["u3"] / sum(t1.values()),
        "tasks": len(window),
    }


def _stream(app: Any, rate: float, seconds: float) -> int:
    """The quiet senders: t1's other users and the other tenants, in turn, at ``rate``/s."""
    senders = [("t1", q) for q in QUIET_T1] + [(t, "u") for t in OTHERS]
    n = int(rate * seconds)
    start = time.monotonic()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # paced publishing, not a race
            tenant, user = senders[i % len(senders)]
            app.send_task(
                "ledger", kwargs={"ms": 2, "tenant_id": tenant, "user_id": user},
                queue=QUEUE, producer=producer,
            )  # fmt: skip
    return n


def flood_run(mode: str, flood: int, rate: float, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("unloaded", "loaded"):
        with RedisServer() as server:
            app = _producer(server.url, mode)
            ledger = Ledger(server.url)
            if phase == "loaded":
                _send(app, [("t1", "flood")] * flood, ms=2)
            with _worker(server.url, mode) as worker:
                if phase == "loaded":  # the worker is busy with the flood first
                    assert ledger.wait_for(300, timeout=120, alive=[worker]), worker.log()[-2000:]
                else:
                    _send(app, [("warm", "up")] * 5, ms=0)
                    assert ledger.wait_for(5, timeout=120, alive=[worker]), worker.log()[-2000:]
                sent = _stream(app, rate, seconds)
                deadline = time.monotonic() + 300
                while _quiet_ran(ledger) < sent:
                    assert time.monotonic() < deadline, "the quiet tasks did not all run"
                    assert worker.proc is not None and worker.proc.poll() is None
                    time.sleep(0.1)  # polled with a deadline
                flood_left = flood - ledger.per_tenant().get("t1", 0) + _quiet_t1(ledger)
            app.close()
            entries = ledger.entries()
        groups = {
            "t1_others": [e for e in entries if e.tenant == "t1" and e.user in QUIET_T1],
            "other_tenants": [e for e in entries if e.tenant in OTHERS],
        }
        out[phase] = {
            name: {
                "n": len(rows),
                "p50_ms": percentile([e.wait * 1000 for e in rows if e.wait is not None], 0.5),
                "p99_ms": percentile([e.wait * 1000 for e in rows if e.wait is not None], 0.99),
            }
            for name, rows in groups.items()
        }
        out[phase]["flood_left"] = flood_left if phase == "loaded" else 0
    return out


def _quiet_ran(ledger: Ledger) -> int:
    counts = ledger.per_tenant()
    return sum(counts.get(t, 0) for t in OTHERS) + _quiet_t1(ledger)


def _quiet_t1(ledger: Ledger) -> int:
    return sum(1 for e in ledger.entries() if e.tenant == "t1" and e.user in QUIET_T1)


def pause_run() -> dict[str, Any]:
    """Pause key a on two workers, resume it later: what started, in what order, lost."""
    import base64

    import redis as redis_lib

    with RedisServer() as server:
        app = _producer(server.url, "one")
        tasks = [t for i in range(300) for t in (("a", str(i)), ("b", str(i)))]
        _send(app, tasks, ms=20)  # user_id carries a sequence number (one-level keys)
        ledger = Ledger(server.url)
        client = redis_lib.Redis.from_url(server.url)
        names = KeyedNames(QUEUE)
        with _worker(server.url, "one") as one, _worker(server.url, "one") as two:
            assert ledger.wait_for(40, timeout=120, alive=[one, two]), one.log()[-2000:]
            replies = _broadcast(app, "fair_key_pause", keys=["a"])
            paused_at = time.time()
            deadline = time.monotonic() + 300
            while ledger.per_tenant().get("b", 0) < 300:
                assert time.monotonic() < deadline, ledger.per_tenant()
                time.sleep(0.1)  # polled with a deadline
            waiting = client.lrange(names.key_list("a"), 0, -1)
            resumed_at = time.time()
            _broadcast(app, "fair_key_resume", keys=["a"])
            assert ledger.wait_for(600, timeout=300, alive=[one, two]), one.log()[-2000:]
        app.close()
        entries = ledger.entries()
    seq = [
        int(json.loads(base64.b64decode(json.loads(m)["body"]))[1]["user_id"])
        for m in reversed(waiting)
    ]
    after = [e.started - paused_at for e in entries
             if e.tenant == "a" and paused_at < e.started < resumed_at]  # fmt: skip
    ids = Counter(e.id for e in entries)
    return {
        "workers_replied": len(replies),
        "a_started_after_pause": len(after),
        "a_latest_start_after_pause_ms": max(after, default=0.0) * 1000,
        "a_waiting_while_paused": len(seq),
        "a_waiting_in_publish_order": seq == sorted(seq),
        "lost": 600 - len(ids),
        "ran_twice": sum(1 for n in ids.values() if n > 1),
    }


def _broadcast(app: Any, command: str, **arguments: Any) -> list[Any]:
    deadline = time.monotonic() + 30
    while True:
        replies = app.control.broadcast(command, arguments=arguments, reply=True, timeout=2)
        if replies:
            return list(replies)
        assert time.monotonic() < deadline, f"no reply to {command}"


def cap_run(producers: int, per_producer: int, cap: int, consume: bool) -> dict[str, Any]:
    """Concurrent producers past a key's cap, with or without a worker consuming."""
    import threading

    import redis as redis_lib

    with RedisServer() as server:
        refused, accepted = [0], [0]
        lock = threading.Lock()
        highest = [0.0]
        done = threading.Event()
        client = redis_lib.Redis.from_url(server.url)
        names = KeyedNames(QUEUE)

        def sample() -> None:
            while not done.is_set():
                highest[0] = max(highest[0], float(client.zscore(names.sizes, "capped") or 0))

        def produce() -> None:
            app = keyed_app(server.url, {QUEUE: "tenant_id"}, "capped",
                            fair_key_max_backlog={"capped": cap})  # fmt: skip
            for _ in range(per_producer):
                try:
                    app.send_task("ledger", kwargs={"tenant_id": "capped"}, queue=QUEUE)
                    ok = True
                except celery_fair.KeyBacklogFull:
                    ok = False
                with lock:
                    (accepted if ok else refused)[0] += 1
            app.close()

        ledger = Ledger(server.url)
        worker = _worker(server.url, "one").start() if consume else None
        try:
            if worker is not None:  # consuming before the producers start
                warm = keyed_app(server.url, {QUEUE: "tenant_id"}, "warm")
                _send(warm, [("warm", "")] * 5, ms=0)
                warm.close()
                assert ledger.wait_for(5, timeout=120, alive=[worker]), worker.log()[-2000:]
            sampler = threading.Thread(target=sample)
            sampler.start()
            threads = [threading.Thread(target=produce) for _ in range(producers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            done.set()
            sampler.join(timeout=60)
            left = int(client.llen(names.key_list("capped")))
            if worker is not None:
                assert ledger.wait_for(5 + accepted[0], timeout=300, alive=[worker])
        finally:
            if worker is not None:
                worker.stop()
        ran = Counter(e.id for e in ledger.entries() if e.tenant == "capped")
    attempted = producers * per_producer
    return {
        "attempted": attempted,
        "accepted": accepted[0],
        "refused": refused[0],
        "excess": attempted - cap,
        "waiting_at_end": left,
        "highest_backlog_seen": highest[0],
        "ran": sum(ran.values()) if consume else None,
        "ran_twice": sum(1 for n in ran.values() if n > 1),
    }


def _layout(keys: int, two: bool) -> list[tuple[str, str | None]]:
    """``keys`` (tenant, user) pairs: one level, or tenants of 10 users each."""
    if not two:
        return [(f"k{i:07d}", None) for i in range(keys)]
    users = min(10, keys)
    return [(f"k{i // users:07d}", f"u{i % users:02d}") for i in range(keys)]


def _fill(
    client: Any, pairs: list[tuple[str, str | None]], per_pair: int, prefix: str,
    behind: bool = False,
) -> None:  # fmt: skip
    """ENQUEUE ``per_pair`` small payloads for each pair (tenants named with ``prefix``).

    ``behind``: their keys' start tags far ahead, so that they wait behind every
    real task (the throughput measurement never reaches them).
    """
    names = KeyedNames(QUEUE)
    client.script_load(ENQUEUE.text)
    pipe = client.pipeline(transaction=False)
    for i, (tenant, user) in enumerate(pairs):
        key = prefix + tenant
        for _ in range(per_pair):
            pipe.evalsha(
                ENQUEUE.sha, 0, *enqueue_args(names, key, fetchable_payload(key, QUEUE), user=user)
            )
        if behind:
            pipe.zadd(names.active, {key: 1e9}, xx=True)
        if i % 2000 == 1999:
            pipe.execute()
    pipe.execute()


def fetch_cost(url: str, keys: int, two: bool, calls: int = 2000) -> float:
    """Microseconds per fetch script call with ``keys`` keys (users) waiting."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    client.flushall()
    pairs = _layout(keys, two)
    _fill(client, pairs, max(1, (calls + keys) // keys + 1) if keys < calls else 1, "")
    sha = client.script_load(FETCH.text)
    args = [1, 0, SEP, "1.0", 0, 0, 0, "1.0"]
    keys_arg = [QUEUE, QUEUE + ".fair-malformed", "unacked", "unacked_index"]
    started = time.perf_counter()
    for _ in range(calls):
        assert client.evalsha(sha, 4, *keys_arg, *args) is not None
    return (time.perf_counter() - started) / calls * 1e6


def throughput_run(keys: int, two: bool, tasks: int) -> float:
    """Worker tasks/s, no-op tasks, with ``keys`` keys (users) in line."""
    import redis as redis_lib

    pairs = _layout(keys, two)
    with RedisServer() as server:
        mode = "two" if two else "one"
        app = _producer(server.url, mode)
        real = pairs[:tasks] if keys >= tasks else pairs
        per_pair = 1 if keys >= tasks else tasks // keys
        # Real tasks: their keys sort first ("a"); the others wait behind ("z").
        _send(app, [("a" + t, u or "") for _ in range(per_pair) for t, u in real], ms=0)
        app.close()
        total = per_pair * len(real)
        if keys > tasks:
            _fill(redis_lib.Redis.from_url(server.url), pairs[tasks:], 1, "z", behind=True)
        ledger = Ledger(server.url)
        with _worker(server.url, mode) as worker:
            assert ledger.wait_for(total, timeout=600, alive=[worker]), worker.log()[-2000:]
        started = sorted(e.started for e in ledger.entries())
    window = started[total // 10 : total - total // 10]  # backlogged: no start-up, no tail
    return (len(window) - 1) / (window[-1] - window[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--per-user", type=int, default=600, help="tasks per user (shares)")
    parser.add_argument("--flood", type=int, default=8000, help="the flooding user's tasks")
    parser.add_argument("--rate", type=float, default=20.0, help="quiet tasks per second")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long quiet work comes")
    parser.add_argument("--tasks", type=int, default=10_000, help="no-op tasks per throughput run")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="keys per cost cell")
    parser.add_argument("--producers", type=int, default=8, help="cap: producer threads")
    parser.add_argument("--per-producer", type=int, default=250, help="cap: tasks each")
    parser.add_argument("--cap", type=int, default=1000, help="cap: the key's backlog cap")
    parser.add_argument("--only", default="shares,flood,pause,cap,cost,throughput")
    parser.add_argument("--name", default="tenants")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {"env": environment(), "args": vars(args)}
    shares: dict[str, list[Any]] = {m: [] for m in MODES}
    flood: dict[str, list[Any]] = {m: [] for m in MODES}
    costs: dict[str, list[float]] = {}
    throughput: dict[str, list[float]] = {}
    pauses: list[dict[str, Any]] = []
    caps: dict[str, list[dict[str, Any]]] = {"idle": [], "consumed": []}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        if "shares" in only:
            for mode in order:
                res = shares_run(mode, args.per_user)
                shares[mode].append(res)
                print(f"rep {rep + 1} shares {mode:5} {res}", flush=True)
        if "flood" in only:
            for mode in order:
                res = flood_run(mode, args.flood, args.rate, args.seconds)
                flood[mode].append(res)
                print(f"rep {rep + 1} flood {mode:5} {res}", flush=True)
        if "pause" in only:
            res = pause_run()
            pauses.append(res)
            print(f"rep {rep + 1} pause {res}", flush=True)
        if "cap" in only:
            for phase in ("idle", "consumed"):
                res = cap_run(args.producers, args.per_producer, args.cap, phase == "consumed")
                caps[phase].append(res)
                print(f"rep {rep + 1} cap {phase} {res}", flush=True)
        levels = (False, True) if rep % 2 == 0 else (True, False)
        if "cost" in only:
            with RedisServer() as server:
                for keys in sizes:
                    for two in levels:
                        us = fetch_cost(server.url, keys, two)
                        costs.setdefault(f"{keys}/{'two' if two else 'one'}", []).append(us)
                        print(f"rep {rep + 1} fetch {keys} keys two={two} {us:.0f} us", flush=True)
        if "throughput" in only:
            for keys in sizes:
                for two in levels:
                    rate = throughput_run(keys, two, args.tasks)
                    throughput.setdefault(f"{keys}/{'two' if two else 'one'}", []).append(rate)
                    print(
                        f"rep {rep + 1} throughput {keys} keys two={two} {rate:.0f} tasks/s",
                        flush=True,
                    )
    results.update(
        shares=shares, flood=flood, costs=costs, throughput=throughput, pauses=pauses, caps=caps
    )
    write(args.name, results, _markdown(results, sizes))
    return 0


def _cell(values: list[float], fmt: str) -> str:
    s = summary(values)
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def _markdown(results: dict[str, Any], sizes: list[int]) -> str:
    env, a = results["env"], results["args"]
    lines = [
        "# Tenant controls: two-level keys (Redis)",
        "",
        f"Reproduce: `python -m bench.tenants --reps {a['reps']}` ({env['when']}, celery "
        f"{env['celery']}, kombu {env['kombu']}, {env['cpus']} CPUs). `celery worker -P prefork "
        "-c 2` with Celery's defaults on a real Redis; the modes alternate: plain Celery (one "
        "FIFO queue), one-level keys (`fair_keys={'jobs': 'tenant_id'}`) and two-level keys "
        "(`('tenant_id', 'user_id')`). Median [min, max] over the repetitions.",
    ]
    if any(results["shares"].values()):
        lines += [
            "",
            f"## Shares: tenants 1:1, t1's users weighted 1:3 ({a['per_user']} tasks of 2 ms "
            "per user, interleaved; tasks run while every user had work)",
            "",
            "| mode | t1 (target 50%) | t2 (target 50%) | u1 within t1 (target 25%) "
            "| u3 within t1 (target 75%) |",
            "|---|---|---|---|---|",
        ]
        for mode, reps in results["shares"].items():
            cells = [_cell([r[k] * 100 for r in reps], ".1f") for k in ("t1", "t2", "u1_in_t1",
                                                                       "u3_in_t1")]  # fmt: skip
            lines.append(f"| {mode} | " + " | ".join(f"{c} %" for c in cells) + " |")
    if any(results["flood"].values()):
        lines += [
            "",
            f"## A flooding user: {a['flood']:,} tasks of 2 ms from one user of t1; four other "
            f"users of t1 and four other tenants send {a['rate']:g} tasks/s in all for "
            f"{a['seconds']:g} s",
            "",
            "| mode | group | p50 unloaded | p99 unloaded | p50 loaded | p99 loaded "
            "| p99 loaded / unloaded | flood left at the end |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mode, reps in results["flood"].items():
            for group in ("t1_others", "other_tenants"):
                ratio = [
                    r["loaded"][group]["p99_ms"] / r["unloaded"][group]["p99_ms"] for r in reps
                ]
                cells = [
                    _cell([r[ph][group][m] for r in reps], ".1f")
                    for ph in ("unloaded", "loaded")
                    for m in ("p50_ms", "p99_ms")
                ]
                left = _cell([r["loaded"]["flood_left"] for r in reps], ".0f")
                lines.append(
                    f"| {mode} | {group} | " + " | ".join(f"{c} ms" for c in cells)
                    + f" | {_cell(ratio, '.2f')} | {left} |"
                )  # fmt: skip
    if results["pauses"]:
        lines += [
            "",
            "## Pause: two workers, keys a and b with 300 tasks of 20 ms each; a paused after "
            "40 tasks ran, resumed once b was done (one row per repetition)",
            "",
            "| a's tasks started after the pause reply | the latest, ms after it | a's messages "
            "waiting while paused | in publish order | lost | run twice |",
            "|---|---|---|---|---|---|",
        ]
        for r in results["pauses"]:
            lines.append(
                f"| {r['a_started_after_pause']} | {r['a_latest_start_after_pause_ms']:.0f} "
                f"| {r['a_waiting_while_paused']} | {r['a_waiting_in_publish_order']} "
                f"| {r['lost']} | {r['ran_twice']} |"
            )
    if any(results["caps"].values()):
        lines += [
            "",
            f"## Cap: {a['producers']} producer threads, {a['per_producer']} tasks each, one "
            f"key capped at {a['cap']:,} (one row per repetition)",
            "",
            "| worker | attempted | accepted | refused | excess over the cap | highest backlog "
            "seen | waiting at the end | ran | run twice |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for phase, reps in results["caps"].items():
            for r in reps:
                lines.append(
                    f"| {'consuming' if phase == 'consumed' else 'none'} | {r['attempted']} "
                    f"| {r['accepted']} | {r['refused']} | {r['excess']} "
                    f"| {r['highest_backlog_seen']:.0f} | {r['waiting_at_end']} "
                    f"| {r['ran'] if r['ran'] is not None else '-'} | {r['ran_twice']} |"
                )
    if results["costs"]:
        lines += [
            "",
            "## The fetch script alone, microseconds per call (2,000 calls; two levels: "
            "tenants of 10 users each)",
            "",
            "| keys (users) | one level | two levels | two / one |",
            "|---|---|---|---|",
        ]
        for keys in sizes:
            one, two = results["costs"][f"{keys}/one"], results["costs"][f"{keys}/two"]
            ratio = summary(two)["median"] / summary(one)["median"]
            lines.append(f"| {keys:,} | {_cell(one, '.0f')} | {_cell(two, '.0f')} | {ratio:.2f} |")
    if results["throughput"]:
        lines += [
            "",
            f"## Worker throughput, no-op tasks ({a['tasks']:,} per run, the middle 80% measured)",
            "",
            "| keys (users) | one level, tasks/s | two levels, tasks/s | two / one |",
            "|---|---|---|---|",
        ]
        for keys in sizes:
            one, two = results["throughput"][f"{keys}/one"], results["throughput"][f"{keys}/two"]
            ratio = summary(two)["median"] / summary(one)["median"]
            lines.append(f"| {keys:,} | {_cell(one, '.0f')} | {_cell(two, '.0f')} | {ratio:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
