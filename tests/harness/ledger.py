"""The run ledger: every task that ran, read back from Redis, and the statistics made of it.

The workload's ``ledger`` task appends one JSON entry per run to the Redis
list ``ledger`` (task id, worker, queue, tenant, publish / start / finish
times, CoDel requeues) and counts runs per tenant in the hash
``ledger:tenants``. The ledger is kept on its own ``redis-server`` so that it
works the same whichever broker is measured.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ("Entry", "Ledger", "client_for", "percentile", "record_entry", "spread")

#: One Redis client per ledger URL and process: a new connection per task would
#: add a TCP handshake to every task's run time.
_CLIENTS: dict[str, Any] = {}

#: How long a task's write to the ledger keeps trying.  The ledger is the tests'
#: evidence of what ran: a run whose one write failed (a new connection's
#: handshake timed out on a loaded machine) would read as a task that never ran.
WRITE_FOR = 60.0

#: ``ledger_record.lua`` registered with each URL's client: sent by its SHA (EVALSHA),
#: its text only when the server does not know it yet.
_SCRIPTS: dict[str, Any] = {}


def client_for(url: str) -> Any:
    """This process's client of the ledger's Redis at ``url``."""
    client = _CLIENTS.get(url)
    if client is None:
        import redis

        # Timeouts on every redis-py (before 5 it waits forever for a lost reply).
        client = _CLIENTS[url] = redis.Redis.from_url(
            url, socket_timeout=10, socket_connect_timeout=10
        )
    return client


def record_entry(
    url: str, key: str, entry: dict[str, Any], count: tuple[str, str] | None = None
) -> None:
    """Append ``entry`` to the list ``key`` and, given ``count = (hash, field)``,
    add one to ``field`` of ``hash``: exactly once, however often it is sent.

    A write that fails on the connection is tried again until :data:`WRITE_FOR`
    passes; a fresh token per call makes an attempt after one that did land a
    no-op (``ledger_record.lua``)."""
    import uuid
    from pathlib import Path

    import redis

    script = _SCRIPTS.get(url)
    if script is None:
        text = Path(__file__).with_name("ledger_record.lua").read_text()
        script = _SCRIPTS[url] = client_for(url).register_script(text)
    keys = ["ledger:recorded", key, *([count[0]] if count else [])]
    args = [uuid.uuid4().hex, json.dumps(entry), count[1] if count else ""]
    deadline = time.monotonic() + WRITE_FOR
    while True:
        try:
            script(keys=keys, args=args, client=client_for(url))
            return
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@dataclass(frozen=True)
class Entry:
    """One run of one task, as the worker recorded it."""

    id: str
    worker: str
    queue: str | None
    tenant: str | None
    published: float | None
    started: float
    finished: float
    requeues: int
    #: The user within the tenant (two-level keys), if the task had one.
    user: str | None = None
    #: What the run declared it holds (``fair_resources``), if anything.
    resources: dict[str, float] | None = None

    @property
    def wait(self) -> float | None:
        """Publish -> start, seconds (``None`` if the producer did not stamp it)."""
        return None if self.published is None else self.started - self.published


class Ledger:
    """Read and reset the ledger kept in the Redis at ``url``."""

    def __init__(self, url: str) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url)

    def reset(self) -> None:
        """Forget every entry and counter."""
        self.client.delete("ledger", "ledger:tenants", "ledger:recorded")

    def count(self) -> int:
        """Runs recorded so far."""
        return int(self.client.llen("ledger"))

    def per_tenant(self) -> dict[str, int]:
        """Runs recorded so far per tenant (cheap: one hash read)."""
        raw = self.client.hgetall("ledger:tenants")
        return {k.decode(): int(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def entries(self, start: int = 0) -> list[Entry]:
        """Every run recorded (from the ``start``-th on), in the order they were recorded."""
        out = []
        for raw in self.client.lrange("ledger", start, -1):
            e: dict[str, Any] = json.loads(raw)
            out.append(
                Entry(
                    id=e["id"],
                    worker=str(e.get("worker") or ""),
                    queue=e.get("queue"),
                    tenant=e.get("tenant"),
                    published=e.get("published"),
                    started=float(e["started"]),
                    finished=float(e.get("finished") or e["started"]),
                    requeues=int(e.get("requeues") or 0),
                    user=e.get("user"),
                    resources=e.get("resources"),
                )
            )
        return out

    def wait_for(
        self,
        n: int,
        *,
        timeout: float,
        alive: Iterable[Any] = (),
        poll: float = 0.1,
    ) -> bool:
        """Poll until ``n`` runs are recorded; ``False`` at the deadline.

        ``alive`` are :class:`~tests.harness.harness.WorkerProcess`
        objects that must keep running; one that exits raises with its log.
        """
        workers = list(alive)
        deadline = time.monotonic() + timeout
        while True:
            for w in workers:
                if w.proc is None or w.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early:\n{w.log()[-3000:]}")
            if self.count() >= n:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and relative spread ``(max - min) / median`` of repetitions."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "spread": 0.0, "n": 0}
    med = statistics.median(finite)
    return {
        "median": med,
        "min": min(finite),
        "max": max(finite),
        "spread": (max(finite) - min(finite)) / med if med else 0.0,
        "n": len(finite),
    }
