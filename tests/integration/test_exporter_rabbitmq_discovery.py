"""``celery-fair exporter --rabbitmq-api`` finds the vhost's queues, as it does on Redis."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from tests.harness.exporter import ExporterProcess, Samples

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


def _queues(samples: Samples) -> set[str]:
    return {
        dict(labels)["queue"]
        for name, labels in samples
        if name == "celery_fair_queue_backlog" and "queue" in dict(labels)
    }


def _listed(broker_url: str, api: str) -> set[str]:
    """Every queue of the vhost ``/``, as the management API lists it."""
    import base64
    import json
    import urllib.request

    conn = Connection(broker_url)
    token = base64.b64encode(f"{conn.userid}:{conn.password}".encode()).decode()
    request = urllib.request.Request(
        f"{api}/api/queues/%2F", headers={"Authorization": f"Basic {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return {q["name"] for q in json.loads(response.read())}


def test_a_queue_declared_only_by_a_producers_call_is_scraped() -> None:
    from tests.harness.rabbitmq import RabbitMQServer

    with RabbitMQServer(management=True) as server:
        app = Celery("discover-amqp", broker=server.url, set_as_current=False)
        with Connection(server.url) as conn:
            # Celery's own queues, as a worker and `celery events` declare them.
            ex = Exchange("discover.test", type="fanout")
            for name in ("w1@host.celery.pidbox", "celeryev.1234", "x.reply.celery.pidbox"):
                Queue(name, ex, channel=conn.default_channel).declare()
        try:
            for _ in range(4):
                # No task_queues, no route, no setting names it: only the call.
                app.send_task("x", queue="adhoc_amqp")
            # A remote-control round trip: its reply queue lives while the app's
            # connection does (a server-named amq.gen-* may come with it too).
            app.control.ping(timeout=0.5)
            api = ("--rabbitmq-api", server.management_url, "--discover-every", "1")
            with ExporterProcess(server.url, [], *api) as exporter:
                samples = exporter.wait_until(lambda s: "adhoc_amqp" in _queues(s), timeout=30)
                assert samples[("celery_fair_queue_backlog", (("queue", "adhoc_amqp"),))] == 4
                assert samples[("celery_fair_exporter_up", ())] == 1.0
                # Found later at the same cadence: a queue declared after the start.
                app.send_task("x", queue="later_amqp")
                samples = exporter.wait_until(lambda s: "later_amqp" in _queues(s), timeout=30)
            listed = _listed(server.url, server.management_url)
            found = _queues(samples)
            assert {"adhoc_amqp", "later_amqp"} <= found, found
            # Celery's own were on the broker, and are left out.
            assert {"w1@host.celery.pidbox", "celeryev.1234", "x.reply.celery.pidbox"} <= listed
            assert not any(
                q.endswith(".pidbox") or q.startswith(("celeryev.", "amq.")) for q in found
            ), found
        finally:
            app.close()
        # Without discovery, the management API alone names no queue: refused.
        done = subprocess.run(
            [sys.executable, "-m", "celery_fair.cli", "exporter", "-b", server.url, "--once",
             "--rabbitmq-api", server.management_url, "--discover-every", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and "no queues" in done.stderr, done.stderr
