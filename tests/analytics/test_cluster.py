"""`celery-fair report` on a real standalone Spark cluster: `--master spark://` and spark-submit.

A master and one worker (1 core, 1 GiB) from the installed PySpark's
``spark-class``, on loopback and free ports, started once for the module and
stopped by PID at the end. Skipped only when there is no Java runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_fair.analytics import report as report_module
from tests.harness.spark_cluster import StandaloneCluster, java_missing, spark_home
from tests.harness.synthetic import SyntheticSpec, Truth, write_synthetic

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(java_missing() is not None, reason=java_missing() or ""),
    pytest.mark.timeout(600),
]

SPEC = SyntheticSpec(records=20_000, seed=21)
# Small executors: the worker offers 1 GiB, the driver keeps to 1 GiB.
EXECUTOR = ["--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=1"]
RUN_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[StandaloneCluster]:
    with StandaloneCluster(cores=1, memory="1g") as running:
        yield running


@pytest.fixture(scope="module")
def telemetry(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Truth]:
    path = tmp_path_factory.mktemp("telemetry")
    truth = write_synthetic(SPEC, path, chunk=5_000)
    return path.resolve().as_uri(), truth  # a file:// URI, as any Spark path may be


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    assert proc.returncode == 0, f"{cmd[:3]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def _finished_apps(cluster: StandaloneCluster, count: int) -> list[dict[str, Any]]:
    # The master lists an application as completed shortly after its driver stops.
    deadline = time.monotonic() + 30
    while True:
        apps: list[dict[str, Any]] = cluster.status()["completedapps"]
        if len(apps) >= count or time.monotonic() > deadline:
            return apps
        time.sleep(0.2)


def _check(report: dict[str, Any], truth: Truth) -> None:
    assert report["meta"]["records"] == SPEC.records
    for q in SPEC.queues():
        assert report["queues"][q]["share"] == pytest.approx(truth.share(q), abs=0.02)
    assert report["noisy_tenants"][0]["fair_key"].endswith("-k000")  # Zipf: rank 1 is hot


def test_report_with_master_url(
    cluster: StandaloneCluster, telemetry: tuple[str, Truth], tmp_path: Path
) -> None:
    uri, truth = telemetry
    cmd = [sys.executable, "-m", "celery_fair.cli", "report", uri, "--master", cluster.url]
    cmd += ["--out", str(tmp_path), "--no-charts", "--driver-memory", "1g", *EXECUTOR]
    _run(cmd, cluster.env())
    _check(json.loads((tmp_path / "report.json").read_text()), truth)
    [app] = _finished_apps(cluster, 1)
    # It ran on the cluster's one worker, with the executor asked for.
    assert (app["name"], app["state"], app["cores"]) == ("celery-fair-report", "FINISHED", 1)
    assert app["memoryperexecutor"] == 512


def test_report_under_spark_submit(
    cluster: StandaloneCluster, telemetry: tuple[str, Truth], tmp_path: Path
) -> None:
    uri, truth = telemetry
    env = dict(cluster.env(), PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    before = len(cluster.status()["completedapps"])
    cmd = [str(spark_home() / "bin" / "spark-submit"), "--master", cluster.url]
    cmd += ["--driver-memory", "1g", *EXECUTOR, str(Path(report_module.__file__))]
    # With charts: run as a script, the report must not import its own html.py as "html".
    cmd += [uri, "--out", str(tmp_path)]
    _run(cmd, env)
    report = json.loads((tmp_path / "report.json").read_text())
    _check(report, truth)
    assert (tmp_path / "report.html").stat().st_size > 10_000
    apps = _finished_apps(cluster, before + 1)
    assert len(apps) == before + 1
    assert apps[-1]["name"] == "celery-fair-report" and apps[-1]["cores"] == 1
