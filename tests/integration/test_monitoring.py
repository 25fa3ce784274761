"""The shipped Prometheus rules and Grafana dashboard, against a real Prometheus and a real run.

``promtool test rules`` runs the rules' unit tests.  Then a real ``prometheus``
scrapes the exporter and a worker's metrics endpoint while a worker serves a
keyed queue (a key at its concurrency limit, a task without a key) and two
plain queues with CoDel on, next to a worker without celery-fair on the keyed
queue and a message for a task nobody knows: every query of every dashboard
panel must return data.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery

from tests.harness.exporter import ExporterProcess
from tests.harness.harness import QUICK_STOP, WorkerProcess, fill_queues
from tests.harness.keys import keyed_app, publish_by_key
from tests.harness.prometheus import PrometheusServer

pytestmark = [pytest.mark.integration]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "celery-fair.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "celery-fair.json"
KEYED = "jobs"


def test_promtool_checks_and_tests_the_rules() -> None:
    checked = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        ["promtool", "test", "rules", RULES.with_suffix(".test.yml").name],
        cwd=RULES.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def _panel_queries() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']} [{target['refId']}]": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }


def _metrics_address(worker: WorkerProcess) -> str:
    deadline = time.monotonic() + 60
    while True:
        found = re.search(r"Prometheus metrics on http://([\d.]+:\d+)/metrics", worker.log())
        if found:
            return found.group(1)
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
        assert time.monotonic() < deadline, worker.log()[-2000:]
        time.sleep(0.1)


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(redis_url: str) -> None:
    queries = _panel_queries()
    assert len(queries) >= 15
    producer = keyed_app(redis_url, {KEYED: "tenant_id"})
    try:
        publish_by_key(producer, KEYED, {"a": 400, "b": 400}, ms=20)
        # Long tasks: the key limited to one task at a time stays at its limit for
        # minutes, however late Prometheus starts scraping.
        publish_by_key(producer, KEYED, {"held": 200}, ms=500)
    finally:
        producer.close()
    plain = Celery("monitoring-plain", broker=redis_url, set_as_current=False)
    try:
        for _ in range(40):  # a producer without fair_keys: no key
            plain.send_task("ledger", queue=KEYED)
        plain.send_task("no.such.task", queue="fast")  # parked: no worker knows it
    finally:
        plain.close()
    fill_queues(redis_url, {"fast": 3000, "slow": 3000}, task="nap", args=(5,))
    env = {
        "CELERY_FAIR_LEDGER": redis_url,
        "CELERY_FAIR_KEYS": f"{KEYED}=tenant_id",
        "CELERY_FAIR_KEY_CONCURRENCY": "held=1",
        "CELERY_FAIR_WEIGHTS": "fast=2,slow=1",
        "CELERY_FAIR_CODEL": "0.002,0.02",  # strict: prefetched 5 ms tasks go stale
        "CELERY_FAIR_METRICS_PORT": "0",
        "CELERY_FAIR_UNKNOWN_MAX_RETURNS": "0",
    }
    queues = [KEYED, "fast", "slow"]
    client = redis_lib.Redis.from_url(redis_url)
    exporter_env = {
        "CELERY_FAIR_BROKER": redis_url,
        "CELERY_FAIR_KEYS": f"{KEYED}=tenant_id,jobs2=tenant_id",
    }
    with (
        # Four slots: the key limited to one task is tried while its task runs.
        WorkerProcess(redis_url, queues, concurrency=4, env=env) as worker,
        # A worker without celery-fair on a keyed queue (it would never see the keyed
        # messages); another one than the fair worker's, so that it takes none of its
        # unkeyed tasks.
        WorkerProcess(redis_url, ["jobs2"], fair=False, concurrency=1),
        ExporterProcess(
            redis_url, queues, "--consumers-every", "2", app="tests.harness.workload",
            env=exporter_env,
        ) as exporter,
    ):  # fmt: skip
        targets = [exporter.address, _metrics_address(worker)]
        with PrometheusServer(targets, rule_files=[RULES]) as prometheus:
            # What KEDA's Prometheus scaler would read, against the LLEN others read.
            keda = "sum(celery_fair_queue_backlog{queue='jobs'})"
            seen: dict[str, list[float]] = {keda: [], "LLEN jobs": []}
            # Each panel has data, and the run's events show in it.
            missing = {
                **queries,
                "the plain worker, found": "celery_fair_keyed_plain_consumers{queue='jobs2'} == 1",
                "the parked message": "sum(celery_fair_queue_parked{queue='fast'}) == 1",
                "the key at its limit": "max(celery_fair_keys_throttled) >= 1",
                "CoDel returning": "sum(rate(celery_fair_codel_requeued_total[5m])) > 0",
                "tasks without a key": "sum(celery_fair_keyed_unkeyed_tasks_total) >= 1",
            }
            deadline = time.monotonic() + 120
            while missing:
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-2000:]
                for name, expr in list(missing.items()):
                    if prometheus.query(expr):
                        del missing[name]
                found = prometheus.query(keda)
                if found:
                    seen[keda].append(float(found[0]["value"][1]))
                    seen["LLEN jobs"].append(float(client.llen(KEYED)))
                assert time.monotonic() < deadline, f"no data for: {missing}"
                time.sleep(1)
        worker.stop(QUICK_STOP)  # measured
    print("KEDA's metric during the run:", seen)  # docs/monitoring.md quotes a run
    # The keyed backlog was there for the scaler, and invisible to LLEN.
    assert max(seen[keda]) >= 500 and max(seen["LLEN jobs"]) <= 1
