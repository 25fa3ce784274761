"""`celery-fair report` as a user runs it, on telemetry shaped like a multi-tenant deployment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from celery_fair.analytics.report import SHORT_RUN_JAVA_OPTIONS
from tests.harness.synthetic import tenant_spec, write_synthetic
from tests.report_command import clean_environment, run_report

#: Spark's warning for a window function over the whole data set, which moves
#: every row to one partition: it does not scale out on a cluster.
UNPARTITIONED = "No Partition Defined for Window operation"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 queues serving the same 2,000 tenants, one with 40% of every queue's tasks."""
    path = tmp_path_factory.mktemp("tenants")
    write_synthetic(tenant_spec(50_000), path)
    return path


def test_the_report_uses_no_window_without_a_partition_and_says_what_it_wrote(
    tenants: Path, tmp_path: Path
) -> None:
    """Spark's default log level (WARN) names every window over all rows; none is logged.
    With --json, stdout is one object (what was read, counted and written), not the
    summary.  One run for both: each report costs a JVM's start-up."""
    out = tmp_path / "report"
    proc, report = run_report(tenants, out, "--master", "local[2]", "--json")
    assert "WARN" in proc.stderr  # Spark's warnings are shown, so the check can see one
    assert UNPARTITIONED not in proc.stderr
    assert sorted(report["queues"]) == [f"q{i}" for i in range(8)]
    said = json.loads(proc.stdout)
    assert said == {
        "directory": str(tenants),
        "records": 50_000,
        "queues": 8,
        "keys": sum(len(keys) for keys in report["keys"].values()),
        "noisy_tenants": len(report["noisy_tenants"]),
        "written": {"report.json": str(out / "report.json")},  # --no-charts: no PNG, no HTML
    }
    assert said["keys"] > 0 and said["noisy_tenants"] > 0
    # 50,000 records, 2.7 MB: the JVM ran with a short run's options (read from the JVM;
    # the tests keep no class archive, test_jvm_archive.py does).
    assert report["meta"]["driver_java_options"] == SHORT_RUN_JAVA_OPTIONS


def test_a_local_report_listens_on_loopback_only_and_starts_a_short_runs_jvm(
    tenants: Path,
) -> None:
    """Without SPARK_LOCAL_IP the local Spark (driver, block manager, UI) binds 127.0.0.1 only.
    Over small telemetry its JVM runs with the short run's options."""
    script = (
        "import json, sys, psutil\n"
        "from celery_fair.analytics.report import driver_java_options, session, short_run_conf\n"
        "spark = session('local[1]', conf=short_run_conf(sys.argv[1], 'local[1]', {}))\n"
        "spark.range(3).count()\n"
        "jvms = psutil.Process().children(recursive=True)\n"
        "print(json.dumps([sorted({c.laddr.ip for p in jvms\n"
        "    for c in p.net_connections(kind='inet') if c.status == psutil.CONN_LISTEN}),\n"
        "    [p.cmdline() for p in jvms if 'java' in p.name()],\n"
        "    [driver_java_options(spark, o) for o in (sys.argv[2], '-XX:+UseSerialGC')]]))\n"
        "spark.stop()\n"
    )
    env = {k: v for k, v in clean_environment().items() if k != "SPARK_LOCAL_IP"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tenants), SHORT_RUN_JAVA_OPTIONS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    addresses, commands, seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert addresses  # the driver listens somewhere
    assert set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1"}, addresses
    drivers = [c for c in commands if "org.apache.spark.deploy.SparkSubmit" in c]
    assert len(drivers) == 1, commands
    assert set(SHORT_RUN_JAVA_OPTIONS.split()) <= set(drivers[0]), drivers[0]
    # report.json's meta is read from the running JVM: None for an option it lacks.
    assert seen == [SHORT_RUN_JAVA_OPTIONS, None]
