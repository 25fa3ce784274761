"""Admission before the broker fills: the flood is refused first, quiet tenants go on.

A real Redis (or Valkey) with ``maxmemory`` and ``noeviction``, one worker
as deployments start it, and two producers with ``fair_broker_memory_high =
0.8``: one floods with 4 KB tasks for as long as it is let in, the other
publishes a few tasks for quiet tenants all along.  The flood is refused with
``BrokerMemoryHigh`` once the broker passes 80% of its ``maxmemory``; the
quiet tenants are never refused and their tasks run while the flood waits;
the broker never reaches its ``maxmemory`` (its peak, from ``INFO``), and
every accepted task runs once.  Without admission the same flood fills the
broker (``test_broker_full.py``).  The ledger lives on another Redis.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import redis as redis_lib

import celery_fair
from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer
from tests.integration.production_app import make_app
from tests.integration.test_broker_full import flood_env
from tests.integration.test_production import APP, assert_clean, running, wait_until

pytestmark = [pytest.mark.integration]

HIGH = 0.8
PAD = "x" * 4000
#: The flood goes on this long after its first refusal, and stops by itself at
#: FLOOD_MAX messages or FLOOD_SECONDS in all.
REFUSED_FOR, FLOOD_MAX, FLOOD_SECONDS = 6.0, 40_000, 90.0
#: Quiet tasks are published every QUIET_EVERY seconds, their values from QUIET_BASE.
QUIET_EVERY, QUIET_BASE = 0.02, 1_000_000
QUIET_KEYS = ("q0", "q1", "q2", "q3")


@dataclass
class Outcome:
    accepted: list[int] = field(default_factory=list)
    refused: list[celery_fair.BrokerMemoryHigh] = field(default_factory=list)
    #: Anything else a publish raised (the broker's own OutOfMemoryError, say).
    failed: list[BaseException] = field(default_factory=list)
    first_refused: float | None = None


def _publish(task: object, value: int, outcome: Outcome, **options: object) -> None:
    try:
        task.apply_async((value,), retry=False, **options)  # type: ignore[attr-defined]
    except celery_fair.BrokerMemoryHigh as exc:
        if outcome.first_refused is None:
            outcome.first_refused = time.time()
        outcome.refused.append(exc)
    except Exception as exc:
        outcome.failed.append(exc)
    else:
        outcome.accepted.append(value)


def _flood(producer: object, kind: str, outcome: Outcome) -> None:
    record = producer.tasks["prod.record"]  # type: ignore[attr-defined]
    start = time.monotonic()
    stop = start + FLOOD_SECONDS
    n = 0
    while n < FLOOD_MAX and time.monotonic() < stop and not outcome.failed:
        options: dict[str, object] = {"queue": "flood", "headers": {"pad": PAD}}
        options["kwargs"] = {"ms": 2, "tenant_id": "noisy"} if kind == "keyed" else {"ms": 2}
        if kind == "priority":
            options["priority"] = n % 10
        refused = len(outcome.refused)
        _publish(record, n, outcome, **options)
        if refused == 0 and outcome.refused:
            stop = min(stop, time.monotonic() + REFUSED_FOR)
        n += 1


@pytest.mark.parametrize(
    # The keyed case in every version set: it goes through Kombu's _put and the
    # push script; the others only through the task sender.
    "kind",
    ["weighted", pytest.param("keyed", marks=pytest.mark.compat), "priority"],
)
def test_the_flood_is_refused_first_and_the_broker_never_fills(
    full_broker: RedisServer, redis_url: str, kind: str
) -> None:
    env = flood_env(full_broker.url, redis_url, kind, PRODUCTION_MEMORY_HIGH=str(HIGH))
    flooder = make_app(env, name="flood-producer")
    quiet = make_app(env, name="quiet-producer")
    worker = WorkerProcess(
        full_broker.url, ["flood", "quiet"], concurrency=2, app=APP, env=env, extra_args=["-E"]
    )
    ledger = redis_lib.Redis.from_url(redis_url)
    broker = full_broker.client()
    maxmemory = int(broker.config_get("maxmemory")["maxmemory"])
    flood, calm = Outcome(), Outcome()
    with running(worker):
        wait_until(lambda: " ready." in worker.log(), "the worker", [worker])
        thread = threading.Thread(target=_flood, args=(flooder, kind, flood), daemon=True)
        thread.start()
        record = quiet.tasks["prod.record"]
        i = 0
        while thread.is_alive():
            options: dict[str, object] = {"kwargs": {"ms": 2}, "queue": "quiet"}
            if kind == "keyed":  # quiet tenants of the flooded queue
                options = {"kwargs": {"ms": 2, "tenant_id": QUIET_KEYS[i % 4]}, "queue": "flood"}
            _publish(record, QUIET_BASE + i, calm, **options)
            i += 1
            time.sleep(QUIET_EVERY)  # a steady trickle, not a wait for a condition
        thread.join()
        accepted = [*flood.accepted, *calm.accepted]
        wait_until(
            lambda: ledger.llen("ledger") >= len(accepted),
            lambda: f"{len(accepted)} runs (ran {ledger.llen('ledger')})",
            [worker], timeout=240,
        )  # fmt: skip
        log = worker.log()
        peak = int(broker.info("memory")["used_memory_peak"])
    assert not flood.failed and not calm.failed, (flood.failed[:3], calm.failed[:3])
    assert flood.refused, "the flood was never refused"
    assert {e.queue for e in flood.refused} == {"flood"}
    assert {e.key for e in flood.refused} == ({"noisy"} if kind == "keyed" else {None})
    assert all(e.used >= HIGH * maxmemory * 0.95 for e in flood.refused)
    # Quiet tenants were never refused, and their tasks ran while the flood was.
    assert not calm.refused, calm.refused[:3]
    entries = [json.loads(raw) for raw in ledger.lrange("ledger", 0, -1)]
    assert flood.first_refused is not None
    quiet_during = [
        e for e in entries if e["value"] >= QUIET_BASE and e["started"] > flood.first_refused
    ]
    assert len(quiet_during) >= 20, len(quiet_during)
    # The broker never filled, and every accepted task ran once.
    assert peak < maxmemory, (peak, maxmemory)
    runs = Counter(e["value"] for e in entries)
    assert set(runs) == set(accepted) and max(runs.values()) == 1
    assert "celery-fair: the broker is full" not in log
    assert_clean(log, worker.name)
    flooder.close()
    quiet.close()


def test_a_bad_admission_setting_names_itself(full_broker: RedisServer) -> None:
    app = make_app({"CELERY_FAIR": "0", "CELERY_FAIR_BROKER": full_broker.url}, name="bad")
    app.conf.fair_broker_memory_high = 0.99  # above the default hard limit, 0.95
    celery_fair.install(app)
    with pytest.raises(celery_fair.FairConfigError, match="fair_broker_memory_high=0.99"):
        app.tasks["prod.record"].apply_async((1,), retry=False)
    app.close()


def test_a_broker_that_refuses_info_admits_everything_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ACL user of docs/operations.md ("Security") has no INFO (@dangerous): admission
    cannot judge, so it refuses nothing and says so once; publishing goes on."""
    acl = "app on >app-secret ~* &* +@all -@dangerous"
    with RedisServer(users=[acl, "default off"]) as server:
        url = server.url_as("app", "app-secret")
        env = flood_env(url, url, "keyed", PRODUCTION_MEMORY_HIGH=str(HIGH))
        app = make_app(env, name="acl-producer")
        record = app.tasks["prod.record"]
        with caplog.at_level("WARNING", logger="celery_fair.kombu.admission"):
            for i in range(20):
                queue = "flood" if i % 2 else "quiet"
                record.apply_async((i,), {"tenant_id": "t"}, queue=queue, retry=False)
        said = [r for r in caplog.records if "refuses INFO" in r.getMessage()]
        assert len(said) == 1 and "+info" in said[0].getMessage()
        client = server.client("app", "app-secret")
        assert client.llen("quiet") == 10
        assert int(client.hget("flood\x06\x16fair.state", "backlog") or 0) == 10
        app.close()
