"""A real Celery app, a real Redis and a real ``celery worker``: one key, one queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from tests.harness.redis import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.router_app"
TENANTS = [f"tenant-{i:03d}" for i in range(40)]
TASKS_PER_TENANT = 5


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def router_app(broker: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setenv("CELERY_FAIR_ROUTER_BROKER", broker.url)
    sys.modules.pop(APP, None)
    import tests.integration.router_app as module

    yield module
    module.app.close()
    sys.modules.pop(APP, None)


class Worker:
    """A ``celery worker`` subprocess in its own session, stopped by its own PID."""

    def __init__(self, broker_url: str, queues: list[str]) -> None:
        fd, path = tempfile.mkstemp(prefix="celery-fair-router-worker-", suffix=".log")
        self.log_path = Path(path)
        env = {**os.environ, "CELERY_FAIR_ROUTER_BROKER": broker_url, "PYTHONUNBUFFERED": "1"}
        args = [
            sys.executable, "-m", "celery", "-A", APP, "worker",
            "-P", "solo", "-c", "1", "-Q", ",".join(queues),
            "-l", "INFO", "-n", f"router-{os.getpid()}@%h",
        ]  # fmt: skip
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def test_tasks_of_one_key_land_on_one_queue_through_a_real_worker(
    broker: RedisServer,
    router_app: ModuleType,
) -> None:
    app, router = router_app.app, router_app.router
    client = redis.Redis.from_url(broker.url)
    client.flushdb()

    # Publish everything before a worker exists, so the broker's queues can be read as sent.
    results = [
        app.tasks["router_app.where"].apply_async((n,), {"tenant_id": tenant})
        for n in range(TASKS_PER_TENANT)
        for tenant in TENANTS
    ]
    expected = {tenant: router.queue_for(tenant) for tenant in TENANTS}
    queued = {q: client.llen(q) for q in router_app.QUEUES}
    assert queued == {
        q: TASKS_PER_TENANT * sum(1 for t in TENANTS if expected[t] == q) for q in router_app.QUEUES
    }
    assert all(n > 0 for n in queued.values()), queued

    worker = Worker(broker.url, list(router_app.QUEUES))
    try:
        deadline = time.monotonic() + 90
        reports = []
        for result in results:
            remaining = deadline - time.monotonic()
            if worker.proc.poll() is not None or remaining <= 0:
                pytest.fail(f"worker gone or too slow:\n{worker.log()}")
            reports.append(result.get(timeout=remaining, interval=0.05))
    finally:
        worker.stop()

    landed: dict[str, set[str]] = {}
    for report in reports:
        landed.setdefault(report["tenant_id"], set()).add(report["queue"])
        assert report["fair_key"] == report["tenant_id"]
    assert landed == {tenant: {queue} for tenant, queue in expected.items()}
    assert Counter(r["queue"] for r in reports) == Counter(queued)
