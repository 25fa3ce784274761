"""``celery-fair capture`` against a real Redis and a real ``celery worker -E``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
from celery import Celery

from celery_fair.telemetry.schema import SCHEMA
from tests.harness.harness import WORKLOAD, WorkerProcess

pytestmark = pytest.mark.integration


def _start_capture(redis_url: str, out: Path) -> subprocess.Popen[str]:
    # The app's settings give the defaults: fair_cost "runtime" (not count, the
    # setting's own default); its fair_weights yield to --queues.
    env = dict(
        os.environ, CELERY_FAIR_BROKER=redis_url, PYTHONUNBUFFERED="1",
        CELERY_FAIR_COST="runtime", CELERY_FAIR_WEIGHTS="alpha=1,beta=1",
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_fair.cli", "capture", "--app", WORKLOAD,
         "--out", str(out), "--queues", "alpha=3,beta=1", "--duration", "120", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the receiver consumes (or exits)
    assert line.startswith("capturing"), line + proc.stdout.read()
    return proc


def _wait_empty(redis_url: str, queues: list[str], timeout: float = 60) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while any(client.llen(q) for q in queues):
        assert time.monotonic() < deadline, "worker did not drain the queues"
        time.sleep(0.1)


def test_capture_maps_task_events_to_records(redis_url: str, tmp_path: Path) -> None:
    producer = Celery("producer", broker=redis_url)
    producer.conf.task_send_sent_event = True
    out = tmp_path / "telemetry"
    with WorkerProcess(redis_url, ["alpha", "beta"], extra_args=["-E"]) as worker:
        capture = _start_capture(redis_url, out)
        try:
            time.sleep(1.0)  # the worker's event dispatcher is up once it consumes
            for _ in range(12):
                producer.send_task("work", args=[500], queue="alpha", routing_key="alpha")
            for _ in range(6):
                producer.send_task("nap", args=[5], queue="beta", routing_key="beta")
            producer.send_task("work", kwargs={"us": "x"}, queue="alpha", routing_key="alpha")
            _wait_empty(redis_url, ["alpha", "beta"])
            time.sleep(2.0)  # the last events reach the receiver
        finally:
            capture.send_signal(signal.SIGTERM)
            output, _ = capture.communicate(timeout=30)
        assert capture.returncode == 0, output + worker.log()[-2000:]
    producer.close()

    table = pq.read_table(out, schema=SCHEMA)
    rows = table.to_pylist()
    assert len(rows) == 19, output
    # --json: the last line is the counts, one object.
    counts = json.loads(output.strip().splitlines()[-1])
    assert counts["records"] == counts["written"] == 19 and counts["dropped"] == 0, output
    by_outcome = {o: [r for r in rows if r["outcome"] == o] for o in ("success", "failure")}
    assert len(by_outcome["success"]) == 18 and len(by_outcome["failure"]) == 1
    assert {r["queue"] for r in rows} == {"alpha", "beta"}
    assert {r["task_name"] for r in rows if r["queue"] == "beta"} == {"nap"}
    for r in rows:
        assert r["source"] == "events" and r["pid"] and "@" in r["hostname"]
        assert r["target_weight"] == {"alpha": 3.0, "beta": 1.0}[r["queue"]]
        # Celery sends task-sent after publishing, so a worker that receives
        # within a millisecond can stamp task-received first; the task has
        # started by then all the same.
        assert r["published"] <= r["started"]
        assert r["received"] <= r["started"] <= r["finished"]
        assert r["fair_key"] is None and r["dispatched"] is None
    for r in by_outcome["success"]:
        assert r["runtime"] > 0 and r["cost"] == r["runtime"]
    naps = [r["runtime"] for r in rows if r["queue"] == "beta"]
    assert min(naps) >= 0.004
