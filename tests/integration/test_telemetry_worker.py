"""End to end: a real worker records telemetry, the Spark report shows the shares."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.harness.harness import run_backlogged
from tests.report_command import run_report

pytestmark = pytest.mark.integration

WEIGHTS = {"t1": 1, "t2": 3}


def test_worker_telemetry_feeds_the_report(redis_url: str, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    telemetry = tmp_path / "telemetry"
    result = run_backlogged(
        redis_url,
        dict.fromkeys(WEIGHTS, 1500),
        target=1200,
        warmup=50,
        args=(200,),
        env={
            "CELERY_FAIR_TELEMETRY_DIR": str(telemetry),
            "CELERY_FAIR_WEIGHTS": ",".join(f"{q}={w}" for q, w in WEIGHTS.items()),
        },
        stop_timeout=45.0,  # the writer flushes at the end of the warm shutdown
    )
    # The worker stopped warmly: every task it ran was flushed to Parquet.
    table = pq.read_table(telemetry).to_pylist()
    ran = sum(result.consumed.values())
    assert len(table) >= ran
    assert {r["outcome"] for r in table} == {"success"}
    assert {r["queue"] for r in table} == set(WEIGHTS)
    first = table[0]
    assert first["received"] <= first["dispatched"] <= first["finished"]
    assert first["target_weight"] in (1.0, 3.0) and first["runtime"] > 0
    assert first["hostname"] and first["pid"]

    _, report = run_report(telemetry, tmp_path / "report", "--master", "local[1]")
    for queue, weight in WEIGHTS.items():
        row = report["queues"][queue]
        assert row["target_share"] == pytest.approx(weight / 4)
        assert row["share"] == pytest.approx(weight / 4, abs=0.04)


def test_revoked_and_expired_tasks_are_recorded(redis_url: str, tmp_path: Path) -> None:
    """A task Celery skips (revoked or expired) gets a record with outcome ``revoked``."""
    pq = pytest.importorskip("pyarrow.parquet")
    import datetime

    import redis as redis_lib

    from tests.harness.control import control_app
    from tests.harness.harness import WorkerProcess

    app = control_app(redis_url)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    expired = [app.send_task("nap", args=(1,), queue="rv", expires=past).id for _ in range(5)]
    fine = [app.send_task("nap", args=(1,), queue="rv").id for _ in range(5)]
    telemetry = tmp_path / "telemetry"
    client = redis_lib.Redis.from_url(redis_url)
    with WorkerProcess(redis_url, ["rv"], env={"CELERY_FAIR_TELEMETRY_DIR": str(telemetry)}) as w:
        deadline = time.monotonic() + 60
        while client.llen("rv") > 0 or w.log().count(" succeeded in ") < len(fine):
            assert time.monotonic() < deadline, w.log()[-3000:]
            time.sleep(0.05)
    # Warm shutdown: running tasks finish, the writer flushes.
    rows = pq.read_table(telemetry).to_pylist()
    outcomes = {r["task_id"]: r["outcome"] for r in rows}
    assert {outcomes.get(i) for i in expired} == {"revoked"}
    assert {outcomes.get(i) for i in fine} == {"success"}
    revoked = next(r for r in rows if r["outcome"] == "revoked")
    assert revoked["queue"] == "rv" and revoked["task_name"] == "nap"
