"""Flower against a celery-fair worker started with ``-E``: it lists the worker and the tasks.

Flower's queue lengths (its broker tab, ``/api/queues/length``) are Redis
``LLEN`` of the queue's own lists: a keyed queue's per-key lists are not in
them, which docs/monitoring.md says, pointing to the exporter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.harness.exporter import ExporterProcess
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key
from tests.harness.redis import free_port, stop_process

pytestmark = [pytest.mark.integration]

KEYED = "jobs"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_flower_lists_a_fair_worker_and_its_tasks(redis_url: str) -> None:
    producer = keyed_app(redis_url, {KEYED: "tenant_id"})
    try:
        publish_by_key(producer, KEYED, {"a": 150, "b": 150}, ms=20)
    finally:
        producer.close()
    port = free_port()
    env = {
        **os.environ,
        "CELERY_FAIR_BROKER": redis_url,
        "CELERY_FAIR_KEYS": f"{KEYED}=tenant_id",
        "FLOWER_UNAUTHENTICATED_API": "true",  # Flower's API without a login, on loopback
    }
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.harness.workload", "flower",
         "--address=127.0.0.1", f"--port={port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    worker_env = {"CELERY_FAIR_KEYS": f"{KEYED}=tenant_id"}
    try:
        with (
            WorkerProcess(redis_url, [KEYED], extra_args=["-E"], env=worker_env) as worker,
            ExporterProcess(redis_url, [KEYED]) as exporter,
        ):
            deadline = time.monotonic() + 90
            workers: dict[str, Any] = {}
            tasks: dict[str, Any] = {}
            lengths: dict[str, Any] = {}
            backlog = None
            while not (
                any(name.startswith(worker.name) for name in workers)
                and sum(t.get("state") == "SUCCESS" for t in tasks.values()) >= 50
                and lengths
            ):
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
                assert flower.poll() is None, "flower exited"
                assert time.monotonic() < deadline, (workers, len(tasks), lengths)
                try:
                    workers = _get(f"{base}/api/workers?refresh=1")
                    tasks = _get(f"{base}/api/tasks")
                    lengths = {
                        q["name"]: q["messages"]
                        for q in _get(f"{base}/api/queues/length")["active_queues"]
                    }
                except (urllib.error.URLError, ConnectionError, KeyError):
                    lengths = {}
                samples = exporter.scrape()
                backlog = samples.get(("celery_fair_queue_backlog", (("queue", KEYED),)))
                time.sleep(0.5)
    finally:
        stop_process(flower)  # type: ignore[arg-type]
    ran = [t for t in tasks.values() if t.get("state") == "SUCCESS"]
    assert ran and all(t.get("name") == "ledger" for t in ran)
    assert {t.get("worker") for t in ran} == {next(n for n in workers if n.startswith(worker.name))}
    # Flower's queue length is LLEN: a keyed backlog is not in it; the exporter has it.
    assert lengths.get(KEYED) == 0
    assert backlog is not None and backlog > 0
