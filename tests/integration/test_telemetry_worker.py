"""End to end: a real worker records telemetry, the Spark report shows the shares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from celery_fair.testing.harness import run_backlogged

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

    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "report", str(telemetry), "--out", str(out),
         "--no-charts", "--master", "local[1]"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for queue, weight in WEIGHTS.items():
        row = report["queues"][queue]
        assert row["target_share"] == pytest.approx(weight / 4)
        assert row["share"] == pytest.approx(weight / 4, abs=0.04)
