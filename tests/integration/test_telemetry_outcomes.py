"""Telemetry from real workers: each outcome, recorded in the process where it is known.

Tasks that run are recorded by the pool process that ran them (with the
receipt and dispatch times the main process stamped into their headers);
a task whose pool process was killed is recorded by the main process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.control import control_app
from tests.harness.harness import WorkerProcess

pytestmark = pytest.mark.integration


def _rows(directory: Path) -> list[dict[str, Any]]:
    pq = pytest.importorskip("pyarrow.parquet")
    return pq.read_table(directory).to_pylist() if directory.exists() else []


def _wait_for_log(worker: WorkerProcess, needle: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while worker.log().count(needle) < count:
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        assert time.monotonic() < deadline, worker.log()[-3000:]
        time.sleep(0.05)


@pytest.mark.compat
def test_prefork_pool_processes_record_success_failure_and_retry(
    redis_url: str, tmp_path: Path
) -> None:
    app = control_app(redis_url)
    ok = [app.send_task("nap", args=(1,), queue="o1").id for _ in range(6)]
    failed = [app.send_task("fail", queue="o2").id for _ in range(3)]
    retried = app.send_task("retry_once", queue="o1").id
    telemetry = tmp_path / "telemetry"
    env = {"CELERY_FAIR_TELEMETRY_DIR": str(telemetry), "CELERY_FAIR_WEIGHTS": "o1=1,o2=3"}
    with WorkerProcess(redis_url, ["o1", "o2"], env=env) as worker:
        # 6 naps + the retried task's second run; 3 failures + its first run.
        _wait_for_log(worker, " succeeded in ", len(ok) + 1)
        _wait_for_log(worker, " raised unexpected: ", len(failed))
        _wait_for_log(worker, " retry: ", 1)
        main_pid = worker.proc.pid if worker.proc is not None else None
    # Warm shutdown: each pool process flushed its own file as it exited.
    rows = _rows(telemetry)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["task_id"], []).append(row)
    assert {by_id[i][0]["outcome"] for i in ok} == {"success"}
    assert all(len(by_id[i]) == 1 for i in ok + failed)
    assert {by_id[i][0]["outcome"] for i in failed} == {"failure"}
    assert sorted(r["outcome"] for r in by_id[retried]) == ["retry", "success"]
    for row in rows:
        assert row["pid"] != main_pid, "a task that ran was recorded by the main process"
        assert row["received"] <= row["dispatched"] <= row["started"] <= row["finished"]
        assert row["runtime"] is not None and row["runtime"] >= 0
        assert row["queue"] == row["routing_key"]
        assert row["target_weight"] == {"o1": 1.0, "o2": 3.0}[row["queue"]]
        assert row["cost"] == 1.0
    naps = [by_id[i][0] for i in ok]
    assert min(r["runtime"] for r in naps) >= 0.001  # each slept 1 ms


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_solo_and_threads_pools_record_in_the_main_process(
    redis_url: str, tmp_path: Path, pool: str
) -> None:
    app = control_app(redis_url)
    ids = [app.send_task("nap", args=(1,), queue="s1").id for _ in range(5)]
    telemetry = tmp_path / "telemetry"
    env = {"CELERY_FAIR_TELEMETRY_DIR": str(telemetry), "CELERY_FAIR_COST": "runtime"}
    with WorkerProcess(redis_url, ["s1"], pool=pool, concurrency=2, env=env) as worker:
        _wait_for_log(worker, " succeeded in ", len(ids))
        main_pid = worker.proc.pid if worker.proc is not None else None
    rows = {r["task_id"]: r for r in _rows(telemetry)}
    assert set(rows) == set(ids)
    for row in rows.values():
        assert row["outcome"] == "success" and row["pid"] == main_pid
        # fair_cost="runtime": the cost recorded is the run time.
        assert row["cost"] == pytest.approx(row["runtime"])
        assert row["received"] <= row["dispatched"] <= row["started"] <= row["finished"]


@pytest.mark.compat
def test_a_task_killed_at_the_hard_time_limit_is_recorded_by_the_main_process(
    redis_url: str, tmp_path: Path
) -> None:
    app = control_app(redis_url)
    killed = app.send_task("nap", args=(30_000,), queue="k1").id
    after = [app.send_task("nap", args=(1,), queue="k1").id for _ in range(3)]
    telemetry = tmp_path / "telemetry"
    env = {"CELERY_FAIR_TELEMETRY_DIR": str(telemetry)}
    with WorkerProcess(
        redis_url, ["k1"], concurrency=1, env=env, extra_args=("--time-limit", "1")
    ) as worker:
        _wait_for_log(worker, "TimeLimitExceeded", 1)
        _wait_for_log(worker, " succeeded in ", len(after))
        main_pid = worker.proc.pid if worker.proc is not None else None
    every = _rows(telemetry)
    rows = {r["task_id"]: r for r in every}
    assert set(rows) == {killed, *after}
    # Once: the terminated pool process does not record the task it was running.
    assert [r["task_id"] for r in every].count(killed) == 1
    lost = rows[killed]
    assert lost["outcome"] == "failure" and lost["pid"] == main_pid
    assert lost["queue"] == "k1" and lost["task_name"] == "nap"
    assert lost["received"] <= lost["dispatched"] <= lost["finished"]
    assert lost["finished"] - lost["dispatched"] >= 1.0  # killed at the 1 s limit
    assert {rows[i]["outcome"] for i in after} == {"success"}
    assert {rows[i]["pid"] for i in after}.isdisjoint({main_pid})
