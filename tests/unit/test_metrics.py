"""Prometheus metrics: the per-task meter and the scrape-time collector."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest

from celery_fair.errors import FairConfigError
from celery_fair.keys.store import KeyControls
from celery_fair.keys.throttling import KeyedLimitsState
from celery_fair.worker.metrics import (
    SOJOURN_BUCKETS,
    DispatchMeter,
    FairCollector,
    MetricsServer,
    require_prometheus_client,
)
from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings

prometheus_client = pytest.importorskip("prometheus_client")


def test_meter_files_sojourns_in_le_buckets() -> None:
    meter = DispatchMeter(buckets=(0.01, 0.1))
    for sojourn in (0.0, 0.01, 0.05, 0.1, 5.0, -1.0):
        meter.dispatched("q", sojourn)
    meter.dispatched("q", None)  # no receipt stamp: counted, not timed
    stats = meter.statistics()
    # le 0.01: 0.0, 0.01 and the negative (clamped); le 0.1: 0.05, 0.1; +Inf: 5.0
    assert stats.sojourn_buckets["q"] == [3, 2, 1]
    assert stats.served == {"q": 7} and stats.cost == {"q": 7.0}
    assert stats.sojourn_sum["q"] == pytest.approx(5.16)


def test_runtime_cost_is_charged_at_finish() -> None:
    meter = DispatchMeter(cost_at_dispatch=False)
    meter.dispatched("q", 0.001)
    assert meter.statistics().cost == {}
    meter.charge("q", 0.25)
    assert meter.statistics().cost == {"q": 0.25}


def test_meter_rejects_bad_buckets() -> None:
    with pytest.raises(ValueError, match="increasing positive"):
        DispatchMeter(buckets=(1.0, 0.5))


def _service() -> tuple[FairService, DispatchMeter]:
    service = FairService(FairSettings(weights={"a": 1, "b": 3}))
    service.scheduler.set_queues(["a", "b"])
    for queue in ("b", "a", "b", "b"):
        service.scheduler.fetched(queue)
    service.scheduler.wait("a", object())
    meter = DispatchMeter()
    meter.dispatched("a", 0.002)
    meter.dispatched("b", 0.2)
    meter.dispatched("b", 0.3)
    return service, meter


def _samples(collector: FairCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def test_collector_reads_the_scheduler_at_scrape_time() -> None:
    service, meter = _service()
    samples = _samples(FairCollector(service, meter, worker="w@h"))

    def value(name: str, queue: str, **extra: str) -> float:
        labels = tuple(sorted({"worker": "w@h", "queue": queue, **extra}.items()))
        return samples[(name, labels)]

    assert value("celery_fair_served_tasks_total", "b") == 2
    assert value("celery_fair_served_cost_total", "a") == 1
    assert value("celery_fair_fetched_tasks_total", "b") == 3
    assert value("celery_fair_held_tasks", "b") == 3
    assert value("celery_fair_buffer_tasks", "a") == 1
    assert value("celery_fair_weight", "b") == 3
    assert value("celery_fair_sojourn_seconds_count", "b") == 2
    assert value("celery_fair_sojourn_seconds_bucket", "b", le="0.25") == 1
    assert value("celery_fair_sojourn_seconds_bucket", "b", le="+Inf") == 2
    assert value("celery_fair_sojourn_seconds_sum", "b") == pytest.approx(0.5)
    # Scrape time is the only time the scheduler is read: a later fetch shows.
    service.scheduler.fetched("a")
    samples = _samples(FairCollector(service, meter, worker="w@h"))
    assert value("celery_fair_fetched_tasks_total", "a") == 2


def test_server_serves_the_text_format_on_loopback() -> None:
    service, meter = _service()
    server = MetricsServer(FairCollector(service, meter, worker="w@h"), port=0, addr="127.0.0.1")
    port = server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.stop()
    assert 'celery_fair_served_tasks_total{queue="b",worker="w@h"} 2.0' in text
    assert "# TYPE celery_fair_sojourn_seconds histogram" in text
    assert "celery_fair_process_resident_memory_bytes" in text
    buckets = [
        line
        for line in text.splitlines()
        if line.startswith("celery_fair_sojourn_seconds_bucket{") and 'queue="b"' in line
    ]
    assert len(buckets) == len(SOJOURN_BUCKETS) + 1  # and +Inf


def test_a_port_in_use_is_a_clear_error() -> None:
    service, meter = _service()
    first = MetricsServer(FairCollector(service, meter), port=0, addr="127.0.0.1")
    port = first.start()
    try:
        second = MetricsServer(FairCollector(service, meter), port=port, addr="127.0.0.1")
        with pytest.raises(FairConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            second.check()
        with pytest.raises(FairConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            second.start()
    finally:
        first.stop()


def test_missing_prometheus_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(FairConfigError, match=r"celery-fair\[prometheus\]"):
        require_prometheus_client()


def test_keyed_queues_export_only_the_top_keys() -> None:
    from celery_fair.worker.metrics import TOP_KEYS

    service = FairService(FairSettings(keys={"jobs": "tenant_id"}))
    assert service.attachment.keyed is not None
    for i in range(50):
        for _ in range(i + 1):
            service.attachment.keyed.served("jobs", f"tenant-{i}")
    for _ in range(3):
        service.attachment.keyed.served("jobs", "")  # sent without a key
    samples = _samples(FairCollector(service, DispatchMeter(), worker="w@h"))
    top = {
        dict(labels)["key"]: value
        for (name, labels), value in samples.items()
        if name == "celery_fair_top_key_served_tasks"
    }
    assert len(top) == TOP_KEYS
    assert top["tenant-49"] == 50 and "tenant-0" not in top
    served = samples[
        ("celery_fair_keyed_served_tasks_total", (("queue", "jobs"), ("worker", "w@h")))
    ]
    assert served == sum(range(1, 51)) + 3
    unkeyed = samples[
        ("celery_fair_keyed_unkeyed_tasks_total", (("queue", "jobs"), ("worker", "w@h")))
    ]
    assert unkeyed == 3


def _limited_service(
    monkeypatch: pytest.MonkeyPatch,
    states: dict[str, KeyedLimitsState] | Exception,
    controls: dict[str, KeyControls] | None = None,
) -> FairService:
    """A service whose broker-side limits state is given (the broker part is tested live)."""
    service = FairService(FairSettings(keys={"jobs": "tenant_id"}))

    def given(found: object) -> Callable[[], object]:
        def read() -> object:
            if isinstance(states, Exception):
                raise states
            return found

        return read

    monkeypatch.setattr(service.keys, "limits_state", given(states))
    monkeypatch.setattr(service.keys, "controls", given(controls or {}))
    return service


def test_paused_keys_are_exported_from_the_brokers_controls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controls = KeyControls(
        paused={"a": 2.0, "b": 1.0}, paused_seconds=4.5, pauses=3, largest=(), top_users={}
    )
    service = _limited_service(monkeypatch, {}, {"jobs": controls})
    samples = _samples(FairCollector(service, DispatchMeter(), worker="w"))
    queue = (("queue", "jobs"), ("worker", "w"))
    assert samples[("celery_fair_keys_paused", queue)] == 2
    assert samples[("celery_fair_key_paused_seconds_total", queue)] == 7.5


def test_throttling_is_exported_from_the_brokers_limits_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = KeyedLimitsState(
        limits={"c:*": "1"}, running={"a": 1}, at_limit=2, sleeping=1,
        throttled_count=7, throttled_seconds=3.5, throttled_tasks=12,
        top_throttled=[("a", 2.5), ("b", 1.0)],
    )  # fmt: skip
    service = _limited_service(monkeypatch, {"jobs": state})
    samples = _samples(FairCollector(service, DispatchMeter(), worker="w"))
    queue = (("queue", "jobs"), ("worker", "w"))
    assert samples[("celery_fair_key_throttled_total", queue)] == 7
    assert samples[("celery_fair_key_throttled_seconds_total", queue)] == 3.5
    assert samples[("celery_fair_key_throttled_tasks", queue)] == 12
    limit = (("limit", "concurrency"), ("queue", "jobs"), ("worker", "w"))
    assert samples[("celery_fair_keys_throttled", limit)] == 2
    top = (("key", "a"), ("queue", "jobs"), ("worker", "w"))
    assert samples[("celery_fair_top_key_throttled_seconds", top)] == 2.5


def test_a_broker_away_leaves_only_the_throttling_metrics_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = _limited_service(monkeypatch, ConnectionError("away"))
    assert service.attachment.keyed is not None
    service.attachment.keyed.served("jobs", "tenant-1")
    collector = FairCollector(service, DispatchMeter())
    names = {name for name, _ in _samples(collector)}
    assert "celery_fair_keyed_served_tasks_total" in names
    assert not any("throttled" in name for name in names)


def test_codel_and_deficit_metrics_read_the_typed_records() -> None:
    from celery_fair.scheduling.shedding import CoDelOptions
    from celery_fair.worker.shedder import Shedder

    service, meter = _service()
    clock = iter(range(1000)).__next__
    shedder = Shedder(CoDelOptions(0.1, 1.0), clock=lambda: float(clock()))
    shedder.requeued_by_queue["a"] = 2
    shedder.rejected_by_queue["b"] = 1
    service.shedder = shedder
    samples = _samples(FairCollector(service, meter, worker="w@h"))
    assert samples[("celery_fair_codel_requeued_total", (("queue", "a"), ("worker", "w@h")))] == 2
    assert samples[("celery_fair_codel_rejected_total", (("queue", "b"), ("worker", "w@h")))] == 1
    assert samples[("celery_fair_codel_dropping", (("worker", "w@h"),))] == 0
    assert samples[("celery_fair_stalls_total", (("place", "pool"), ("worker", "w@h")))] == 0
    deficits = {k for k in samples if k[0] == "celery_fair_deficit"}
    assert {dict(labels)["queue"] for _, labels in deficits} == {"a", "b"}


def test_fair_stats_keeps_its_fields() -> None:
    # inspect fair_stats is read by people and scripts: the snapshot's plain
    # form keeps every field it had.
    service, _ = _service()
    stats = service.statistics()
    assert set(stats) >= {
        "cost", "weights", "held", "credit", "cost_estimate", "fetched", "waiting", "drr",
        "dispatch", "prefetch_windows", "codel", "atomic_fetch", "compat_fallbacks", "keys",
        "bad_input", "stalls",
    }  # fmt: skip
    assert set(stats["drr"]["queues"]["b"]) >= {"quantum", "deficit"}  # type: ignore[index]
    assert stats["bad_input"] == {"parked": {}, "returned": 0, "returning": 0, "errors": 0}


def test_a_broker_away_is_logged_once_per_outage_and_its_return_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = KeyedLimitsState(limits={}, running={}, at_limit=1, sleeping=0)
    outcome: list[object] = [ConnectionError("away")]
    service = FairService(FairSettings(keys={"jobs": "tenant_id"}))

    def read() -> object:
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    monkeypatch.setattr(service.keys, "limits_state", read)
    monkeypatch.setattr(service.keys, "controls", lambda: {})
    assert service.attachment.keyed is not None
    service.attachment.keyed.served("jobs", "tenant-1")
    collector = FairCollector(service, DispatchMeter(), worker="w")
    caplog.set_level("INFO", logger="celery_fair.worker.metrics")
    for _ in range(3):  # three scrapes during the outage
        _samples(collector)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "per-key limits" in warnings[0].getMessage()
    assert "away" in warnings[0].getMessage()
    outcome[0] = {"jobs": state}
    for _ in range(2):
        names = {name for name, _ in _samples(collector)}
    assert "celery_fair_keys_throttled" in names
    back = [r for r in caplog.records if r.levelname == "INFO" and "again" in r.getMessage()]
    assert len(back) == 1
