"""The broker a test runs against: one the user already runs, or a ``redis-server`` of its own."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .redis_server import RedisServer

if TYPE_CHECKING:
    from celery import Celery

__all__ = (
    "BROKER_URL_ENV", "REDIS_SERVER_ENV", "Broker", "BrokerUnavailable", "find_broker",
    "use_broker",
)  # fmt: skip

#: A broker the user runs already (``redis://...`` or ``amqp://...``): tests use it
#: and never delete anything from it.
BROKER_URL_ENV = "CELERY_FAIR_TEST_BROKER_URL"
#: The ``redis-server`` binary to start when no broker URL is given (default: the
#: one on ``PATH``).
REDIS_SERVER_ENV = "CELERY_FAIR_TEST_REDIS_SERVER"

_DEFAULT_PORTS = {"redis": 6379, "rediss": 6380, "amqp": 5672, "amqps": 5671, "pyamqp": 5672}


class BrokerUnavailable(RuntimeError):
    """No broker to test against; the message says how to provide one."""


@dataclass(frozen=True)
class Broker:
    """A broker for tests: its URL, its kind, and whether these tests started it.

    ``kind`` is ``"redis"`` or ``"amqp"``.  ``owned``: the server was started
    for the test session (it may be emptied between tests); a broker the user
    runs is never emptied.
    """

    url: str
    kind: str
    owned: bool

    @property
    def is_redis(self) -> bool:
        return self.kind == "redis"

    def flush(self) -> None:
        """Empty an owned Redis (every database): what one test left behind.

        Does nothing to a broker the tests did not start, nor to RabbitMQ.
        """
        if not (self.owned and self.is_redis):
            return
        import redis

        with redis.Redis.from_url(self.url) as client:
            client.flushall()


def _kind(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss"):
        return "redis"
    if scheme in ("amqp", "amqps", "pyamqp"):
        return "amqp"
    raise BrokerUnavailable(
        f"{BROKER_URL_ENV}={url!r}: celery_fair.testing runs Redis (redis://, rediss://) "
        "or RabbitMQ (amqp://, pyamqp://) brokers"
    )


def _reachable(url: str, timeout: float = 2.0) -> bool:
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 6379)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextmanager
def find_broker() -> Iterator[Broker]:
    """The broker to test against, for as long as the ``with`` block lasts.

    1. ``$CELERY_FAIR_TEST_BROKER_URL``, a Redis or RabbitMQ the user runs
       (refused if nothing listens there);
    2. else a ``redis-server`` (``$CELERY_FAIR_TEST_REDIS_SERVER``, or the one
       on ``PATH``) started on a free 127.0.0.1 port in a temporary directory,
       stopped and removed at the end.

    Raises :class:`BrokerUnavailable` when there is neither (the plugin's
    fixtures turn it into a skip with that reason).
    """
    url = os.environ.get(BROKER_URL_ENV, "").strip()
    if url:
        broker = Broker(url, _kind(url), owned=False)
        if not _reachable(url):
            raise BrokerUnavailable(f"{BROKER_URL_ENV}={url!r}: nothing answers at that address")
        yield broker
        return
    executable = os.environ.get(REDIS_SERVER_ENV, "").strip() or "redis-server"
    found = shutil.which(executable) or shutil.which(executable, path="/usr/bin:/usr/sbin")
    if found is None:
        raise BrokerUnavailable(
            f"no broker to test against: set {BROKER_URL_ENV} (redis://... or amqp://...) "
            f"to a broker you run, or install redis-server ({executable!r} is not on PATH)"
        )
    with RedisServer(executable=found) as server:
        yield Broker(server.url, "redis", owned=True)


@contextmanager
def use_broker(app: Celery, url: str) -> Iterator[Celery]:
    """Point ``app`` (the user's Celery app, in the test's process) at ``url`` for a while.

    Closes the app's cached connections before and after (Celery keeps a pool
    made with the URL it first saw), sets ``broker_url``, and sets
    ``CELERY_BROKER_URL`` too if the environment has it (Celery prefers it to
    the app's setting).  Everything is put back at the end.
    """
    conf: Any = app.conf
    old_url = conf.get("broker_url")
    old_env = os.environ.get("CELERY_BROKER_URL")
    app.close()
    conf.broker_url = url
    if old_env is not None:
        os.environ["CELERY_BROKER_URL"] = url
    try:
        yield app
    finally:
        app.close()
        conf.broker_url = old_url
        if old_env is not None:
            os.environ["CELERY_BROKER_URL"] = old_env
