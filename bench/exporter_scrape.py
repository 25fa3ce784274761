"""What one scrape of ``celery-fair exporter`` costs, at 10, 10,000 and 1,000,000 keys.

For each key count a fresh ``redis-server`` holds one keyed queue with that
many keys (one message each) and four plain queues (with priority lists).
Each repetition times, alternating, the exporter's whole read of the five
queues (:func:`celery_fair.monitoring.readings.read_redis`: backlog, ages,
in-flight, parked, the ten largest keys) and the read an ``LLEN``-based
exporter does (one ``LLEN`` per queue, the baseline: it misses the keyed
backlog).  It also counts the commands each read sends (``INFO
commandstats``): the exporter's must not grow with the keys.

    python -m bench.exporter_scrape                 # 10, 10,000 and 1,000,000 keys
    python -m bench.exporter_scrape --keys 10 10000 --reps 9
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import environment, summary, write
from tests.harness.redis import RedisServer

KEYED, PLAIN = "jobs", ("mail", "reports", "exports", "billing")


def fill(url: str, keys: int) -> None:
    """One message per key in the keyed queue, 100 per plain queue (20 of them prioritised)."""
    import redis
    from celery import Celery

    import celery_fair
    from celery_fair.keys import store
    from celery_fair.keys.layout import KeyedNames

    app = Celery("scrape-fill", broker=url, set_as_current=False)
    celery_fair.install(app)  # the publish stamp the ages come from
    with app.producer_or_acquire() as producer:
        for queue in PLAIN:
            for i in range(100):
                app.send_task("x", queue=queue, producer=producer, priority=5 if i < 20 else None)
        # A keyed message as a producer with fair_keys writes it: the payload of one
        # real publish, under every key (the script is the publish path).
        app.send_task("x", queue=KEYED, producer=producer)
    client = redis.Redis.from_url(url)
    payload = client.rpop(KEYED)
    names = KeyedNames(KEYED)
    sha = client.script_load(store.ENQUEUE.text)
    for start in range(0, keys, 10_000):
        pipe = client.pipeline(transaction=False)
        for k in range(start, min(keys, start + 10_000)):
            pipe.evalsha(sha, 0, *store.enqueue_args(names, f"tenant-{k}", payload))
        pipe.execute()
    app.close()


def commands(client: Any) -> int:
    return sum(int(v["calls"]) for v in client.info("commandstats").values())


def measure(keys: int, reps: int) -> dict[str, Any]:
    import redis
    from kombu import Connection

    from celery_fair.monitoring.readings import read_redis

    with RedisServer() as server:
        started = time.monotonic()
        fill(server.url, keys)
        filled = time.monotonic() - started
        client = redis.Redis.from_url(server.url)
        queues = [KEYED, *PLAIN]
        times: dict[str, list[float]] = {"exporter": [], "llen": []}
        calls: dict[str, int] = {}
        with Connection(server.url) as conn:
            channel = conn.default_channel
            readings = read_redis(channel, queues)  # warm: scripts, connections
            backlog = {r.queue: r.backlog for r in readings}
            for _ in range(reps):
                for label in ("exporter", "llen"):
                    before = commands(client)
                    t0 = time.perf_counter()
                    if label == "exporter":
                        read_redis(channel, queues)
                    else:
                        pipe = client.pipeline(transaction=False)
                        for queue in queues:
                            pipe.llen(queue)
                        pipe.execute()
                    times[label].append(time.perf_counter() - t0)
                    calls[label] = commands(client) - before - 1  # the INFO itself
    return {
        "keys": keys,
        "fill_seconds": filled,
        "backlog": backlog,
        "seconds": {label: summary(values) for label, values in times.items()},
        "commands": calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[10, 10_000, 1_000_000])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--name", default="exporter_scrape")
    args = parser.parse_args(argv)
    rows = []
    for keys in args.keys:
        row = measure(keys, args.reps)
        rows.append(row)
        print(
            f"{keys:>9} keys: exporter {row['seconds']['exporter']['median'] * 1e3:.2f} ms "
            f"({row['commands']['exporter']} commands), LLEN "
            f"{row['seconds']['llen']['median'] * 1e3:.2f} ms, backlog {row['backlog']}",
            flush=True,
        )
    lines = [
        "# One scrape of `celery-fair exporter` against an LLEN-based read",
        "",
        f"`python -m bench.exporter_scrape --keys {' '.join(map(str, args.keys))} "
        f"--reps {args.reps}`; {environment()['when']}. One keyed queue with that many keys "
        "(one message each) and four plain queues of 100 messages (20 in a priority list); "
        "the exporter reads all five, with the ten largest keys. Medians of "
        f"{args.reps} alternating repetitions [min, max].",
        "",
        "| keys | exporter | commands | LLEN per queue | commands | exporter backlog of "
        f"`{KEYED}` | LLEN of `{KEYED}` |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        e, ll = row["seconds"]["exporter"], row["seconds"]["llen"]
        lines.append(
            f"| {row['keys']:,} | {e['median'] * 1e3:.2f} ms [{e['min'] * 1e3:.2f}, "
            f"{e['max'] * 1e3:.2f}] | {row['commands']['exporter']} | "
            f"{ll['median'] * 1e3:.2f} ms [{ll['min'] * 1e3:.2f}, {ll['max'] * 1e3:.2f}] | "
            f"{row['commands']['llen']} | {row['backlog'][KEYED]:,} | 0 |"
        )
    write(args.name, {"environment": environment(), "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
