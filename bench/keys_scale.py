"""Fairness keys at scale: fetch cost, worker throughput and Redis memory per waiting key.

For each number of distinct keys waiting (10, 10,000 and 1,000,000 by
default) a fresh ``redis-server`` is filled with real Celery task messages
(the no-op ``work`` task) published through celery-fair's keyed publish
(``fair_keys``), then:

* **publish**: messages per second of that fill (the keyed publish script
  against Kombu's ``LPUSH``, both pipelined, for the plain baseline);
* **memory**: Redis ``used_memory`` after the fill, per message and per
  waiting key, against the same number of messages in a plain list;
* **fetch cost**: microseconds per fetch-script call from a client on the
  same machine (pops and records the unacked entry), against the atomic
  fetch of a plain list and against Kombu's own two round trips (``RPOP``,
  then the unacked record);
* **throughput**: a real ``celery worker -P prefork -c 2`` consumes the
  backlog; tasks per second between ``--warmup`` and ``--consume`` tasks,
  against plain Celery on a plain queue of the same messages, alternating.

Every run keeps the queue backlogged: at least ``consume + warmup + 5,000``
messages wait, and with a million keys every fetch empties a key (the
costliest case: the key leaves the active set and its finish tag is kept).

    python -m bench.keys_scale [--keys 10,10000,1000000] [--reps 2] [--consume 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

import redis as redis_lib

from celery_fair.keys import store
from celery_fair.keys.layout import KeyedNames
from celery_fair.keys.scripts import FETCH
from celery_fair.wire import KEY_HEADER, KEYED_HEADER
from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer

from .common import environment, summary, write

QUEUE = "scale"
BATCH = 5_000


def template(url: str, task: str = "work", args: tuple[Any, ...] = (0,), queue: str = QUEUE) -> Any:
    """A real Celery message of ``task`` for ``queue`` (published by Celery, then read back)."""
    from celery import Celery

    app = Celery("keys-scale-template", broker=url, set_as_current=False)
    scratch = f"template-{uuid.uuid4().hex}"
    app.send_task(task, args=list(args), queue=scratch)
    app.close()
    client = redis_lib.Redis.from_url(url)
    raw = client.rpop(scratch)
    assert raw is not None
    message: dict[str, Any] = json.loads(raw)  # type: ignore[arg-type]
    message["properties"]["delivery_info"] = {"exchange": "", "routing_key": queue}
    return message


def messages(model: dict[str, Any], n: int, keys: int) -> Any:
    """``n`` copies of ``model`` with fresh ids, key ``k<i % keys>`` (none when ``keys`` is 0).

    Yields ``(key, task id, payload text)``.
    """
    message = json.loads(json.dumps(model))
    queue = model["properties"]["delivery_info"]["routing_key"]
    for i in range(n):
        tid = str(uuid.uuid4())
        message["headers"]["id"] = message["headers"]["root_id"] = tid
        message["properties"]["correlation_id"] = tid
        message["properties"]["delivery_tag"] = str(uuid.uuid4())
        key = f"k{i % keys}" if keys else None
        if key is not None:
            # As celery-fair's sender stamps it: the key and the keyed queue.
            message["headers"][KEY_HEADER] = key
            message["headers"][KEYED_HEADER] = queue
        yield key, tid, json.dumps(message)


def fill(url: str, n: int, keys: int, task_ms: float = 0.0) -> dict[str, float]:
    """Publish ``n`` messages over ``keys`` keys (0: a plain list); rate and memory.

    The tasks are no-ops, or with ``task_ms`` sleep that long (``nap``).
    """
    client = redis_lib.Redis.from_url(url)
    client.script_load(store.ENQUEUE.text)
    model = template(url, "nap", (task_ms,)) if task_ms else template(url)
    names = KeyedNames(QUEUE)
    before = int(client.info("memory")["used_memory"])
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, (key, _, text) in enumerate(messages(model, n, keys)):
        if key is None:
            pipe.lpush(QUEUE, text)
        else:
            pipe.evalsha(store.ENQUEUE.sha, 0, *store.enqueue_args(names, key, text))
        if i % BATCH == BATCH - 1:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - started
    used = int(client.info("memory")["used_memory"]) - before
    waiting = int(client.hget(names.state, "backlog") or 0) if keys else int(client.llen(QUEUE))
    assert waiting == n, (waiting, n)
    if keys:
        assert client.zcard(names.active) == min(keys, n)
    return {"publish_rate": n / elapsed, "memory": used, "per_message": used / n}


def fetch_cost(url: str, keyed: bool, calls: int = 400, batches: int = 5) -> dict[str, float]:
    """Microseconds per fetch: the fetch script (keyed or plain), or Kombu's two round trips."""
    client = redis_lib.Redis.from_url(url)
    sha = client.script_load(FETCH.text)
    malformed = QUEUE + ".fair-malformed"
    word = "1.0" if keyed else "-"
    args = store.fetch_args([word], sep="\x06\x16", now=0.0)  # no other levels, strict
    per_call: list[float] = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(calls):
            reply = client.evalsha(sha, 4, QUEUE, malformed, "unacked", "unacked_index", *args)
            assert reply is not None
        per_call.append((time.perf_counter() - started) / calls * 1e6)
    client.delete("unacked", "unacked_index")
    return summary(per_call)


def kombu_fetch_cost(url: str, calls: int = 400, batches: int = 5) -> dict[str, float]:
    """Plain Kombu: BRPOP (here RPOP) then the unacked record, two round trips."""
    client = redis_lib.Redis.from_url(url)
    per_call: list[float] = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(calls):
            raw = client.rpop(QUEUE)
            assert raw is not None
            tag = str(uuid.uuid4())
            client.pipeline().zadd("unacked_index", {tag: time.time()}).hset(
                "unacked", tag, raw
            ).execute()
        per_call.append((time.perf_counter() - started) / calls * 1e6)
    client.delete("unacked", "unacked_index")
    return summary(per_call)


def throughput(
    url: str,
    keyed: bool,
    warmup: int,
    consume: int,
    extra_env: dict[str, str] | None = None,
    concurrency: int = 2,
) -> float:
    """Tasks per second of one worker, between ``warmup`` and ``consume`` tasks done."""
    client = redis_lib.Redis.from_url(url)
    names = KeyedNames(QUEUE)

    def waiting() -> int:
        if keyed:
            return int(client.hget(names.state, "backlog") or 0) + int(client.llen(QUEUE))
        return int(client.llen(QUEUE))

    start = waiting()
    env = {"CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id", **(extra_env or {})} if keyed else {}
    with WorkerProcess(url, [QUEUE], concurrency=concurrency, fair=keyed, env=env) as worker:
        deadline = time.monotonic() + 600
        t0: float | None = None
        while True:
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            assert time.monotonic() < deadline, "the worker did not consume in time"
            done = start - waiting()
            now = time.perf_counter()
            if t0 is None and done >= warmup:
                t0, d0 = now, done
            if done >= consume + warmup:
                assert t0 is not None and waiting() > 0, "the backlog ran dry"
                return (done - d0) / (now - t0)
            time.sleep(0.02)


def run_one(keys: int, keyed: bool, warmup: int, consume: int) -> dict[str, Any]:
    n = max(keys, consume + warmup + 5_000) if keyed else consume + warmup + 5_000
    with RedisServer() as server:
        filled = fill(server.url, n, keys if keyed else 0)
        cost = fetch_cost(server.url, keyed)
        kombu = None if keyed else kombu_fetch_cost(server.url)
        rate = throughput(server.url, keyed, warmup, consume)
    return {
        "keys": keys if keyed else 0,
        "messages": n,
        **filled,
        "per_key": filled["memory"] / keys if keyed else None,
        "fetch_us": cost,
        "kombu_fetch_us": kombu,
        "throughput": rate,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="10,10000,1000000")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--consume", type=int, default=20_000)
    parser.add_argument("--name", default="keys_scale")
    args = parser.parse_args(argv)
    sizes = [int(k) for k in args.keys.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], **{str(k): [] for k in sizes}}
    for rep in range(args.reps):
        order: list[int | None] = [None, *sizes]  # None: plain Celery
        if rep % 2:
            order.reverse()
        for size in order:
            label = "plain" if size is None else str(size)
            record = run_one(size or 0, size is not None, args.warmup, args.consume)
            runs[label].append(record)
            print(
                f"rep {rep + 1} {label:>8}: {record['throughput']:6.0f} tasks/s, fetch "
                f"{record['fetch_us']['median']:5.1f} us, publish {record['publish_rate']:7.0f}/s, "
                f"{record['per_message']:5.0f} B/message",
                flush=True,
            )
    results = {"env": environment(), "args": vars(args), "runs": runs, "summary": _summary(runs)}
    write(args.name, results, _markdown(results))
    return 0


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, records in runs.items():
        out[label] = {
            "throughput": summary([r["throughput"] for r in records]),
            "fetch_us": summary([r["fetch_us"]["median"] for r in records]),
            "publish_rate": summary([r["publish_rate"] for r in records]),
            "per_message": statistics.median(r["per_message"] for r in records),
            "per_key": (
                statistics.median(r["per_key"] for r in records)
                if records[0]["per_key"] is not None
                else None
            ),
        }
        if records[0]["kombu_fetch_us"] is not None:
            out[label]["kombu_fetch_us"] = summary([r["kombu_fetch_us"]["median"] for r in records])
    return out


def _markdown(results: dict[str, Any]) -> str:
    s, env, args = results["summary"], results["env"], results["args"]
    plain = s["plain"]
    sizes = [k for k in s if k != "plain"]
    smallest = s[sizes[0]]["throughput"]["median"] if sizes else float("nan")
    per_message_plain = plain["per_message"]
    lines = [
        "# Fairness keys at scale",
        "",
        f"Reproduce: `python -m bench.keys_scale --keys {args['keys']} --reps {args['reps']} "
        f"--consume {args['consume']}` ({env['when']}, celery {env['celery']}, kombu "
        f"{env['kombu']}, redis-py {env['redis']}, {env['cpus']} CPUs). Medians over "
        f"{args['reps']} repetitions [min, max]; plain Celery and each size alternate.",
        "",
        "Worker: `celery worker -P prefork -c 2`, no-op tasks (the fetch path is all there "
        f"is to measure); throughput between {args['warmup']:,} and "
        f"{args['warmup'] + args['consume']:,} tasks, the queue backlogged throughout. Fetch: "
        "one client on the same machine, microseconds per call.",
        "",
        "| keys waiting | worker tasks/s | vs plain Celery | vs 10 keys | fetch us/call "
        "| publish msgs/s | Redis bytes per message | extra bytes per waiting key |",
        "|---|---|---|---|---|---|---|---|",
        f"| plain Celery (no keys) | {_fmt(plain['throughput'])} | 100% | - | "
        f"{_fmt(plain['fetch_us'], '.1f')} (Kombu's two round trips: "
        f"{_fmt(plain['kombu_fetch_us'], '.1f')}) | {plain['publish_rate']['median']:,.0f} | "
        f"{per_message_plain:,.0f} | - |",
    ]
    for k in sizes:
        row = s[k]
        t = row["throughput"]["median"]
        extra = (row["per_message"] - per_message_plain) * results["runs"][k][0]["messages"]
        extra_per_key = extra / int(k)
        lines.append(
            f"| {int(k):,} | {_fmt(row['throughput'])} | {t / plain['throughput']['median']:.1%} "
            f"| {t / smallest:.1%} | {_fmt(row['fetch_us'], '.1f')} | "
            f"{row['publish_rate']['median']:,.0f} | {row['per_message']:,.0f} | "
            f"{extra_per_key:,.0f} |"
        )
    lines += [
        "",
        "*Fetch us/call* for plain Celery is the atomic fetch script on a plain list; Kombu's "
        "own fetch (RPOP, then the unacked record) is in brackets. *Extra bytes per waiting "
        "key*: Redis memory above the same messages in one plain list, divided by the keys.",
        "",
    ]
    return "\n".join(lines)


def _fmt(d: dict[str, float] | None, spec: str = ",.0f") -> str:
    if d is None:
        return "-"
    return f"{d['median']:{spec}} [{d['min']:{spec}}, {d['max']:{spec}}]"


if __name__ == "__main__":
    sys.exit(main())
