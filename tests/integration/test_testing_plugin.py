"""celery_fair.testing's fixtures with real brokers and real workers: they start, record,
stop and leave nothing behind; without a broker they skip and say why."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from celery_fair._process import alive
from celery_fair.testing import FairWorker, WorkerFailed, assert_shares, shares

pytestmark = pytest.mark.integration

APP = "tests.harness.workload:app"
ROOT = Path(__file__).resolve().parents[2]


def publish(url: str, counts: dict[str, int], ms: float = 5.0) -> None:
    producer = Celery("producer", broker=url, set_as_current=False)
    try:
        with producer.producer_or_acquire() as conn:
            for i in range(max(counts.values())):
                for queue, n in counts.items():
                    if i < n:
                        producer.send_task("nap", args=(ms,), queue=queue, producer=conn)
    finally:
        producer.close()


def test_a_worker_starts_ready_records_and_stops_leaving_no_process(
    fair_worker: Callable[..., FairWorker], fair_broker_url: str
) -> None:
    publish(fair_broker_url, {"p0": 120, "p1": 120})
    with fair_worker(
        APP, queues=["p0", "p1"], concurrency=2, settings={"fair_weights": {"p0": 3, "p1": 1}}
    ) as worker:
        assert worker.ping()
        pids = worker.pids()
        assert worker.pid in pids and len(pids) == 3, pids  # main process and two pool processes
        assert all(alive(pid) for pid in pids)
        records = worker.wait_for_records(240, timeout=60)
    assert worker.proc is None and not any(alive(pid) for pid in pids), pids
    assert {r.queue for r in records} == {"p0", "p1"} and {r.name for r in records} == {"nap"}
    assert {r.pid for r in records} <= pids and len({r.id for r in records}) == 240
    assert_shares(records, {"p0": 3, "p1": 1}, tolerance=0.2)
    # The helper fails on the same records against weights the worker did not have.
    with pytest.raises(AssertionError, match="differ from the weights"):
        assert_shares(records, {"p0": 1, "p1": 1}, tolerance=0.2)


def test_plain_celery_fails_the_share_assertion(
    fair_worker: Callable[..., FairWorker], fair_broker_url: str
) -> None:
    # The same backlog without celery-fair: Kombu's round robin, about 1:1.
    publish(fair_broker_url, {"p0": 100, "p1": 100})
    with fair_worker(APP, queues=["p0", "p1"], concurrency=2, env={"CELERY_FAIR": "0"}) as worker:
        records = worker.wait_for_records(200, timeout=60)
    assert "celery-fair" not in worker.log(tail=100_000)
    with pytest.raises(AssertionError, match="differ from the weights"):
        assert_shares(records, {"p0": 3, "p1": 1}, tolerance=0.2)
    assert shares(records)["p0"] == pytest.approx(0.5, abs=0.1)


def test_a_threads_pool_records_every_task_once(
    fair_worker: Callable[..., FairWorker], fair_broker_url: str
) -> None:
    # Several threads of one process write to one file: whole lines, none lost.
    publish(fair_broker_url, {"p0": 150}, ms=2)
    with fair_worker(APP, queues=["p0"], pool="threads", concurrency=6) as worker:
        records = worker.wait_for_records(150, timeout=60)
        main = worker.pid
        assert worker.pids() == {main}  # threads: no pool process
    assert len({r.id for r in records}) == len(records) == 150
    assert {r.pid for r in records} == {main}


def test_a_worker_past_its_stop_timeout_is_killed_with_its_pool(
    fair_broker_url: str, tmp_path: Path
) -> None:
    publish(fair_broker_url, {"slow": 2}, ms=60_000)
    worker = FairWorker(
        APP, fair_broker_url, queues=["slow"], concurrency=2, stop_timeout=1.0, workdir=tmp_path
    )
    with worker:
        pids = worker.pids()
        assert len(pids) == 3
    # The warm shutdown waited for the minute-long tasks; past a second it was killed.
    assert not any(alive(pid) for pid in pids), pids
    assert worker.stop() is None  # stopping again does nothing


def test_a_worker_that_cannot_start_fails_with_its_log(
    fair_broker_url: str, tmp_path: Path
) -> None:
    worker = FairWorker("no_such_module_here:app", fair_broker_url, workdir=tmp_path)
    with pytest.raises(WorkerFailed, match=r"(?s)is not running \(exit \d+\).*no_such_module_here"):
        worker.start()
    assert worker.proc is None


def run_pytest(tmp_path: Path, test: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``test`` as a user's test file, in a directory of its own, with the plugin."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(test))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_FAIR_TEST_")}
    environ["PYTHONPATH"] = str(ROOT)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "celery_fair.testing.plugin", "-rs", "-q",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


USER_TESTS = """
    def test_needs_a_broker(fair_broker_url):
        assert fair_broker_url

    def test_needs_nothing(fair_clock):
        fair_clock.advance(2)
        assert fair_clock() == 2
"""


def test_without_a_broker_the_tests_that_need_one_are_skipped_saying_why(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, USER_TESTS, CELERY_FAIR_TEST_REDIS_SERVER="no-such-redis-server")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout, done.stdout
    assert (
        "celery_fair.testing: no broker to test against: set CELERY_FAIR_TEST_BROKER_URL "
        "(redis://... or amqp://...) to a broker you run, or install redis-server "
        "('no-such-redis-server' is not on PATH)"
    ) in done.stdout, done.stdout


def test_a_broker_url_nothing_answers_at_is_an_error(tmp_path: Path) -> None:
    from celery_fair.testing import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    done = run_pytest(tmp_path, USER_TESTS, CELERY_FAIR_TEST_BROKER_URL=url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 1 error" in done.stdout, done.stdout
    assert f"CELERY_FAIR_TEST_BROKER_URL='{url}': nothing answers at that address" in done.stdout


def test_a_broker_the_user_runs_is_used_and_not_emptied(tmp_path: Path, redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.set("users-data", "kept")
    test = (
        USER_TESTS
        + f"""
    def test_is_the_users(fair_broker, fair_broker_url):
        assert fair_broker_url == {redis_url!r} and not fair_broker.owned
    """
    )
    done = run_pytest(tmp_path, test, CELERY_FAIR_TEST_BROKER_URL=redis_url)
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout + done.stderr
    assert client.get("users-data") == b"kept"


def test_the_sessions_own_redis_is_emptied_between_tests(tmp_path: Path) -> None:
    test = """
    import redis

    def test_a(fair_broker_url, fair_broker):
        assert fair_broker.owned
        redis.Redis.from_url(fair_broker_url).set("left", 1)

    def test_b(fair_broker_url):
        assert redis.Redis.from_url(fair_broker_url).get("left") is None
    """
    done = run_pytest(tmp_path, test)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr


@pytest.mark.rabbitmq
def test_a_worker_on_rabbitmq_records_and_shares_by_weight(
    rabbitmq_server: object, tmp_path: Path
) -> None:
    import uuid

    url = rabbitmq_server.url  # type: ignore[attr-defined]
    p0, p1 = (f"t{i}-{uuid.uuid4().hex[:6]}" for i in range(2))
    publish(url, {p0: 120, p1: 120})
    worker = FairWorker(
        APP, url, queues=[p0, p1], concurrency=2, workdir=tmp_path,
        settings={"fair_weights": {p0: 3, p1: 1}},
    )  # fmt: skip
    with worker:
        pids = worker.pids()
        records = worker.wait_for_records(240, timeout=60)
    assert not any(alive(pid) for pid in pids), pids
    assert {r.queue for r in records} == {p0, p1}
    assert_shares(records, {p0: 3, p1: 1}, tolerance=0.2)
