"""Shared fixtures: real brokers on free loopback ports, one per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.harness.redis import RedisServer

# Spark's driver and web UI, in the tests and in the commands they start, listen
# on loopback only (without it Spark binds the UI to every interface).
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session", autouse=True)
def worker_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The logs of the workers the tests start go to the session's temporary
    directory, which pytest prunes (the last three sessions' are kept), not to
    the system's temporary directory, where every run would leave hundreds."""
    folder = tmp_path_factory.mktemp("worker-logs")
    before = os.environ.get("CELERY_FAIR_TEST_LOGS")
    os.environ["CELERY_FAIR_TEST_LOGS"] = str(folder)
    yield
    if before is None:
        os.environ.pop("CELERY_FAIR_TEST_LOGS", None)
    else:
        os.environ["CELERY_FAIR_TEST_LOGS"] = before


@pytest.fixture(scope="session", autouse=True)
def jvm_archives() -> Iterator[None]:
    """The reports the tests run keep no class archive of their JVMs
    (:mod:`celery_fair.analytics.jvm_archive`): each runs as a first report does, not
    writing to the user's cache. ``tests/analytics/test_jvm_archive.py`` keeps one."""
    from celery_fair.analytics.jvm_archive import ENV

    before = os.environ.get(ENV)
    os.environ[ENV] = "off"
    yield
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real ``redis-server`` in a temporary directory."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session's Redis, emptied after each test."""
    import redis

    yield redis_server.url
    redis.Redis.from_url(redis_server.url).flushdb()


#: The ``maxmemory`` of :func:`full_broker`: small enough to fill in seconds,
#: large enough for a worker's own keys.
MAXMEMORY = "24mb"


@pytest.fixture
def full_broker() -> Iterator[RedisServer]:
    """A Redis of its own with a small ``maxmemory`` and ``noeviction`` (a broker's policy)."""
    with RedisServer() as server:
        client = server.client()
        client.config_set("maxmemory", MAXMEMORY)
        client.config_set("maxmemory-policy", "noeviction")
        yield server


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[object]:
    """A real RabbitMQ (consistent-hash plugin enabled), one per test session."""
    from tests.harness.rabbitmq import RabbitMQServer

    with RabbitMQServer() as server:
        yield server
