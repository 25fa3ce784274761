"""Helpers for tests and benchmarks of keyed queues: publish by key, read concurrency."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = (
    "fetchable_payload", "keyed_app", "keyed_consistency", "most_at_once", "publish_by_key",
)  # fmt: skip


def keyed_app(
    broker_url: str, fair_keys: Mapping[str, Any], name: str = "keyed-producer", **conf: Any
) -> Any:
    """A producer app with celery-fair, these ``fair_keys`` and other settings ``conf``
    (the user's surface)."""
    from celery import Celery

    import celery_fair

    app = Celery(name, broker=broker_url, set_as_current=False)
    app.conf.fair_keys = dict(fair_keys)
    app.conf.update(conf)
    celery_fair.install(app)
    return app


def publish_by_key(
    app: Any, queue: str, counts: Mapping[str, int], ms: float, priority: int | None = None
) -> None:
    """Publish ``counts[key]`` ``ledger(ms, tenant_id=key)`` tasks, the keys interleaved.

    Interleaved, so that publish order favours no key.  ``priority``: Celery's
    ``priority`` argument of every task (on Redis, 0 is served first).
    """
    left = dict(counts)
    with app.producer_or_acquire() as producer:
        while any(left.values()):
            for key in counts:
                if left[key]:
                    left[key] -= 1
                    app.send_task(
                        "ledger", kwargs={"ms": ms, "tenant_id": key}, queue=queue,
                        producer=producer, priority=priority,
                    )  # fmt: skip


def most_at_once(entries: Iterable[Any]) -> dict[str, int]:
    """Per tenant, the most ledger entries that overlapped in time (a sweep over start/finish)."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in entries:
        events[e.tenant or ""] += [(e.started, 1), (e.finished, -1)]
    most: dict[str, int] = {}
    for key, points in events.items():
        running = peak = 0
        for _, step in sorted(points):  # at a tie, a finish (-1) sorts before a start
            running += step
            peak = max(peak, running)
        most[key] = peak
    return most


def restore_unacked(app: Any, client: Any, visibility: float, timeout: float = 30.0) -> int:
    """Restore every unacknowledged message, as any Redis consumer does once the
    visibility timeout passed; returns how many there were.

    ``app`` is a producer app with celery-fair installed (keyed messages go back
    to their keys' lists in their levels); ``client`` a redis-py client of the
    same Redis; ``visibility`` the seconds the messages must have waited.
    """
    import time

    held = int(client.hlen("unacked"))
    app.conf.broker_transport_options = {"visibility_timeout": visibility}
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        deadline = time.monotonic() + timeout
        while client.hlen("unacked"):
            assert time.monotonic() < deadline, "the unacked messages were not restored"
            channel.qos.restore_visible(num=500)
            time.sleep(0.2)  # polled with a deadline: waits for the visibility timeout
    return held


def fetchable_payload(key: str, queue: str) -> str:
    """The smallest Kombu Redis payload the fetch script serves (a delivery tag, a key):
    for measuring the scripts alone, never for a worker."""
    return json.dumps(
        {
            "body": "",
            "headers": {"fair_key": key},
            "properties": {
                "delivery_tag": str(uuid.uuid4()),
                "delivery_info": {"exchange": queue, "routing_key": queue},
            },
        }
    )


def keyed_consistency(client: Any, queue: str, sep: str = "\x06\x16") -> dict[str, Any]:
    """Check a keyed queue's state on the broker (one-level keys, first priority level).

    Returns counts (``waiting``, ``leases``, ``running``) and ``problems``, each
    a sentence; none when:

    * every key with messages waiting is in line, or set aside (at its
      concurrency limit, by its rate, or paused): no key is stranded;
    * each key's running count equals its leases, and every lease has an
      expiry: no slot is held without a lease that frees it;
    * a key set aside at its concurrency limit has that many leases, or it
      would never be put back in line.

    The key lists are found with SCAN, then everything is read in one
    transaction: a consistent snapshot even under load.  For tests and
    benchmarks, not for a loaded production Redis.
    """
    from celery_fair.keys.layout import KeyedNames

    names = KeyedNames(queue, sep)

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    prefix = names.key_list("")
    lists = [
        raw for raw in client.scan_iter(match=prefix + "*", count=1000)
        if sep not in text(raw)[len(prefix) :]  # a two-level key's user lists: not checked
    ]  # fmt: skip
    # One snapshot (MULTI/EXEC runs between two scripts): read one by one under
    # load, a fetch or a release would fall between the reads.
    pipe = client.pipeline(transaction=True)
    for raw in lists:
        pipe.llen(raw)
    pipe.zrange(names.active, 0, -1).smembers(names.at_limit).zrange(names.sleep, 0, -1)
    pipe.smembers(names.paused).hgetall(names.lease_keys).zrange(names.leases, 0, -1)
    pipe.hgetall(names.running).hgetall(names.limits_conf).hgetall(names.limits_live)
    *lengths, active, at_limit, sleep, paused_, leased, expiring, counts, conf, live = (
        pipe.execute()
    )
    waiting = {text(raw)[len(prefix) :]: int(n) for raw, n in zip(lists, lengths, strict=True)}
    in_line = {text(k) for k in active}
    aside = {text(k) for k in at_limit}
    sleeping = {text(k) for k in sleep}
    paused = {text(k) for k in paused_}
    lease_keys = {text(t): text(k) for t, k in leased.items()}
    expiries = {text(t) for t in expiring}
    running = {text(k): int(v) for k, v in counts.items()}
    limits = {text(f): text(v) for f, v in conf.items()}
    limits.update({text(f): text(v) for f, v in live.items()})
    problems: list[str] = []
    for key, n in sorted(waiting.items()):
        if n and key not in in_line | aside | sleeping | paused:
            problems.append(f"key {key!r}: {n} message(s) waiting, neither in line nor set aside")
    per_key: dict[str, int] = defaultdict(int)
    for key in lease_keys.values():
        per_key[key] += 1
    for key in sorted(set(per_key) | set(running)):
        if per_key.get(key, 0) != running.get(key, 0):
            problems.append(
                f"key {key!r}: running count {running.get(key, 0)}, leases {per_key.get(key, 0)}"
            )
    if set(lease_keys) != expiries:
        problems.append(
            f"leases without an expiry: {sorted(set(lease_keys) - expiries)}; "
            f"expiries without a lease: {sorted(expiries - set(lease_keys))}"
        )
    for key in sorted(aside):
        limit = limits.get(f"c:{key}", limits.get("c:*"))
        if limit is None or per_key.get(key, 0) < int(limit):
            problems.append(
                f"key {key!r}: set aside at its concurrency limit ({limit}) with "
                f"{per_key.get(key, 0)} lease(s): nothing would put it back in line"
            )
    return {
        "waiting": sum(waiting.values()),
        "leases": len(lease_keys),
        "running": sum(running.values()),
        "problems": problems,
    }
