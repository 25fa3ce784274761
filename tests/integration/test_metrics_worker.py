"""Prometheus metrics served by a real ``celery worker`` (``fair_metrics_port``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
import redis as redis_lib

from tests.harness.harness import WorkerProcess, fill_queues
from tests.harness.redis import free_port

pytestmark = pytest.mark.integration
prometheus_client = pytest.importorskip("prometheus_client")

FAMILIES = (
    "celery_fair_served_tasks",
    "celery_fair_served_cost",
    "celery_fair_fetched_tasks",
    "celery_fair_weight",
    "celery_fair_deficit",
    "celery_fair_held_tasks",
    "celery_fair_buffer_tasks",
    "celery_fair_codel_requeued",
    "celery_fair_codel_rejected",
    "celery_fair_codel_dropping",
    "celery_fair_sojourn_seconds",
    "celery_fair_stalls",
    "celery_fair_stall_repaired_slots",
    "celery_fair_process_resident_memory_bytes",
)


def scrape(port: int, worker: WorkerProcess, timeout: float = 30) -> dict[str, dict]:
    """``{family: {(sample name, queue label): value}}``, polling until it answers."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, "the metrics endpoint never answered"
            time.sleep(0.1)
    return {
        family.name: {
            (s.name, s.labels.get("queue"), s.labels.get("le")): s.value for s in family.samples
        }
        for family in text_string_to_metric_families(text)
    }


def ran_by_queue(url: str) -> Counter[str]:
    entries = redis_lib.Redis.from_url(url).lrange("ledger", 0, -1)
    return Counter(json.loads(e)["queue"] for e in entries)


def wait_ran(url: str, n: int, worker: WorkerProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sum(ran_by_queue(url).values()) < n:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        assert time.monotonic() < deadline, f"{sum(ran_by_queue(url).values())} of {n} ran"
        time.sleep(0.05)


def value(metrics: dict[str, dict], family: str, queue: str, suffix: str = "", **le: str) -> float:
    """One sample; a family without a sample for ``queue`` reads 0."""
    return metrics[family].get((family + suffix, queue, le.get("le")), 0.0)


def served(metrics: dict[str, dict], queue: str) -> float:
    return value(metrics, "celery_fair_served_tasks", queue, "_total")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_metrics_count_every_task_and_follow_the_weights(redis_url: str, pool: str) -> None:
    counts = {"m1": 300, "m3": 900}
    fill_queues(redis_url, counts, task="ledger", args=(2,))
    port = free_port()
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_METRICS_PORT": str(port)}
    with WorkerProcess(
        redis_url, list(counts), pool=pool, env=env, extra_args=["--fair-weights", "m1=1,m3=3"]
    ) as worker:
        wait_ran(redis_url, 200, worker)
        first = scrape(port, worker)
        wait_ran(redis_url, 800, worker)  # both queues still backlogged
        second = scrape(port, worker)
        wait_ran(redis_url, sum(counts.values()), worker)
        deadline = time.monotonic() + 30
        while True:  # the last scrape may race the last acknowledgement
            final = scrape(port, worker)
            held = sum(value(final, "celery_fair_held_tasks", q) for q in counts)
            if held == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert "celery-fair: Prometheus metrics on http://127.0.0.1:" in worker.log()
    for family in FAMILIES:
        assert family in final, family
    ran = ran_by_queue(redis_url)
    assert ran == counts
    for queue, n in counts.items():
        assert served(final, queue) == n
        assert value(final, "celery_fair_served_cost", queue, "_total") == n
        assert value(final, "celery_fair_fetched_tasks", queue, "_total") == n
        assert value(final, "celery_fair_sojourn_seconds", queue, "_count") == n
        assert value(final, "celery_fair_sojourn_seconds", queue, "_bucket", le="+Inf") == n
        assert value(final, "celery_fair_buffer_tasks", queue) == 0
        assert value(final, "celery_fair_held_tasks", queue) == 0
    assert value(final, "celery_fair_weight", "m3") == 3
    # Between two scrapes while both queues were backlogged: the weights' shares.
    delta = {q: served(second, q) - served(first, q) for q in counts}
    assert delta["m3"] / sum(delta.values()) == pytest.approx(0.75, abs=0.05), delta


def test_metrics_port_in_use_stops_the_worker_with_a_clear_error(redis_url: str) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        worker = WorkerProcess(
            redis_url, ["m1"], env={"CELERY_FAIR_METRICS_PORT": str(port)}
        ).start()
        try:
            assert worker.wait(timeout=60) != 0
        finally:
            worker.stop()
    # One line, as for every bad setting (no traceback).
    assert f"Error: fair_metrics_port: cannot listen on 127.0.0.1:{port}" in worker.log()
    assert "Traceback" not in worker.log()
