"""A throw-away RabbitMQ broker on free loopback ports, for tests and the demo.

``RabbitMQServer`` runs the ``rabbitmq-server`` of the Debian package in a
temporary directory that holds everything the node writes: configuration,
Erlang cookie, Mnesia/message store and logs.  Nothing is read from or written
to the system-wide ``/etc/rabbitmq``, ``/var/lib/rabbitmq`` or
``/var/log/rabbitmq``.

Everything listens on 127.0.0.1 only: AMQP (``port``), Erlang distribution
(``dist_port``) and a private ``epmd`` on its own free port (``epmd_port``), so
the node neither collides with nor registers in a system ``epmd``.  The CLI
tools run by :meth:`RabbitMQServer.ctl` get the same environment.

The plugin ``rabbitmq_consistent_hash_exchange`` is enabled offline through
the ``enabled_plugins`` file before the node starts.  When run as root the
node runs as the ``rabbitmq`` user (the Debian wrapper in ``/usr/sbin`` does
the same with ``su``), and the temporary directory is handed to that user.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.harness.redis import free_port
from tests.harness.tls import Certificates

__all__ = ("RabbitMQCluster", "RabbitMQServer")

#: Where the Debian package ``rabbitmq-server`` keeps the real scripts; the
#: ones in ``/usr/sbin`` are wrappers that ``cd /var/lib/rabbitmq`` and ``su``.
DEBIAN_BIN_DIR = Path("/usr/lib/rabbitmq/bin")

DEFAULT_PLUGINS: tuple[str, ...] = ("rabbitmq_consistent_hash_exchange",)

#: AMQP 0-9-1 protocol header; a ready broker answers with a Connection.Start frame.
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"

#: Erlang arguments that keep a node's distribution listener on loopback.
_LOOPBACK_DIST_ARGS = "-kernel inet_dist_use_interface {127,0,0,1}"


class RabbitMQServer:
    """Run a private RabbitMQ node in a temporary directory, bound to loopback only.

    ``restart()`` reuses the ports, node name and data directory, so durable
    queues and persistent messages survive it, as with a broker restarted by
    an operator.  ``restart(kill=True)`` simulates a crash (SIGKILL).

    ``tls``: also an ``amqps`` listener (``tls_port``) with these certificates,
    the client's certificate verified when it presents one.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        plugins: Sequence[str] = DEFAULT_PLUGINS,
        bin_dir: str | os.PathLike[str] | None = None,
        management: bool = False,
        tls: Certificates | None = None,
        peer: RabbitMQServer | None = None,
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir is not None else DEBIAN_BIN_DIR
        self.server_script = self.bin_dir / "rabbitmq-server"
        if not os.access(self.server_script, os.X_OK):
            raise RuntimeError(
                f"{self.server_script} not found: run `make setup` (it installs the Debian "
                "package rabbitmq-server)"
            )
        epmd = shutil.which("epmd") or shutil.which("epmd", path="/usr/bin:/usr/lib/erlang/bin")
        if epmd is None:
            raise RuntimeError("'epmd' not found: the Debian package erlang-base provides it")
        self.epmd_executable = epmd
        self.port = port or free_port()
        self.dist_port = free_port()
        #: A cluster's nodes share the first node's epmd and Erlang cookie (``peer``).
        self.peer = peer
        self.epmd_port = peer.epmd_port if peer is not None else free_port()
        #: The management plugin's HTTP API on loopback (``management_url``), when asked for.
        self.management_port = free_port() if management else None
        self.plugins = tuple(plugins) + (("rabbitmq_management",) if management else ())
        self.tls = tls
        self.tls_port = free_port() if tls is not None else None
        self.nodename = f"rabbit-{self.port}@localhost"
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-rabbitmq-"))
        self.log_dir = self.dir / "log"
        self.log_file = self.log_dir / "rabbit.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.epmd_proc: subprocess.Popen[bytes] | None = None
        self._user = self._run_as()
        self._prepare_dir()

    @property
    def cookie(self) -> str:
        """The Erlang cookie the node and its CLI tools share (and a cluster's nodes)."""
        return (self.dir / "home" / ".erlang.cookie").read_text()

    @property
    def management_url(self) -> str:
        """The management plugin's HTTP API (only with ``management=True``)."""
        if self.management_port is None:
            raise RuntimeError("this node was started without management=True")
        return f"http://127.0.0.1:{self.management_port}"

    @property
    def url(self) -> str:
        """The AMQP URL of the default vhost, as user ``guest``."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def tls_url(self) -> str:
        """The ``amqps`` URL of the default vhost (only with ``tls``)."""
        if self.tls_port is None:
            raise RuntimeError("this node was started without tls")
        return f"amqps://guest:guest@127.0.0.1:{self.tls_port}//"

    def ssl_options(self, *, client_cert: bool = False) -> dict[str, Any]:
        """Celery's ``broker_use_ssl`` for the ``amqps`` listener: the CA required
        (``cert_reqs`` 2 is ``ssl.CERT_REQUIRED``), and a client certificate if asked."""
        if self.tls is None:
            raise RuntimeError("this node was started without tls")
        options: dict[str, Any] = {"ca_certs": str(self.tls.ca), "cert_reqs": 2}
        if client_cert:
            options.update(certfile=str(self.tls.client_cert), keyfile=str(self.tls.client_key))
        return options

    # -- set-up ---------------------------------------------------------------

    @staticmethod
    def _run_as() -> pwd.struct_passwd | None:
        """The ``rabbitmq`` user when running as root (like the Debian wrapper), else None."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam("rabbitmq")
        except KeyError:
            return None

    def _prepare_dir(self) -> None:
        etc, home = self.dir / "etc", self.dir / "home"
        for sub in (etc, etc / "conf.d", home, self.dir / "mnesia", self.log_dir):
            sub.mkdir(parents=True, exist_ok=True)
        conf = "loopback_users.guest = true\nlog.console = false\nlog.file.level = info\n"
        if self.management_port is not None:
            conf += f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {self.management_port}\n"
        if self.tls is not None:
            # Copies the node's user can read (a test's temporary directory is private).
            certs = etc / "tls"
            certs.mkdir()
            for name, source in (("ca.pem", self.tls.ca), ("cert.pem", self.tls.server_cert),
                                 ("key.pem", self.tls.server_key)):  # fmt: skip
                shutil.copyfile(source, certs / name)
            conf += (
                f"listeners.ssl.default = 127.0.0.1:{self.tls_port}\n"
                f"ssl_options.cacertfile = {certs / 'ca.pem'}\n"
                f"ssl_options.certfile = {certs / 'cert.pem'}\n"
                f"ssl_options.keyfile = {certs / 'key.pem'}\n"
                "ssl_options.verify = verify_peer\n"
                "ssl_options.fail_if_no_peer_cert = false\n"
            )
        (etc / "rabbitmq.conf").write_text(conf)
        (etc / "rabbitmq-env.conf").write_text("")
        (etc / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")
        cookie = home / ".erlang.cookie"
        cookie.write_text(self.peer.cookie if self.peer else secrets.token_hex(20).upper())
        cookie.chmod(0o400)
        if self._user is not None:
            uid, gid = self._user.pw_uid, self._user.pw_gid
            for root, dirs, files in os.walk(self.dir):
                os.chown(root, uid, gid)
                for name in dirs + files:
                    os.chown(os.path.join(root, name), uid, gid)

    def _env(self) -> dict[str, str]:
        """Environment for the node and its CLI tools: everything points into ``dir``."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_", "NOTIFY_SOCKET"))
        }
        etc = self.dir / "etc"
        env.update(
            HOME=str(self.dir / "home"),
            LC_ALL="C.UTF-8",
            LANG="C.UTF-8",
            ERL_EPMD_ADDRESS="127.0.0.1",
            ERL_EPMD_PORT=str(self.epmd_port),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_USE_LONGNAME="false",
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=_LOOPBACK_DIST_ARGS,
            RABBITMQ_CTL_ERL_ARGS=_LOOPBACK_DIST_ARGS,
            RABBITMQ_CONF_ENV_FILE=str(etc / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(etc / "rabbitmq.conf"),
            RABBITMQ_CONFIG_FILES=str(etc / "conf.d"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(etc / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(etc / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"),
            RABBITMQ_MNESIA_DIR=str(self.dir / "mnesia" / self.nodename),
            RABBITMQ_PID_FILE=str(self.dir / "mnesia" / f"{self.nodename}.pid"),
            RABBITMQ_LOG_BASE=str(self.log_dir),
            RABBITMQ_LOGS=str(self.log_file),
        )
        path = env.get("PATH", "")
        if "/usr/bin" not in path.split(os.pathsep):  # erl, epmd
            env["PATH"] = f"{path}{os.pathsep}/usr/bin" if path else "/usr/bin:/bin"
        if self._user is not None:
            env.update(USER=self._user.pw_name, LOGNAME=self._user.pw_name)
        return env

    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"env": self._env(), "cwd": self.dir, "start_new_session": True}
        if self._user is not None:
            kwargs.update(user=self._user.pw_uid, group=self._user.pw_gid, extra_groups=[])
        return kwargs

    # -- life cycle -----------------------------------------------------------

    def start(self, timeout: float = 90.0) -> RabbitMQServer:
        """Start epmd and the node; return once the node accepts AMQP logins.

        Raises ``RuntimeError`` with the tail of the logs if the node exits or
        is not ready within ``timeout`` seconds.
        """
        if self.proc is not None and self.proc.poll() is None:
            return self
        deadline = time.monotonic() + timeout
        self._start_epmd(deadline)
        with (
            open(self.log_dir / "startup_log", "ab") as out,
            open(self.log_dir / "startup_err", "ab") as err,
        ):
            self.proc = subprocess.Popen(
                [str(self.server_script)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                **self._popen_kwargs(),
            )
        try:
            self._wait_ready(deadline, timeout)
        except BaseException:
            self.stop(kill=True)
            raise
        return self

    def _start_epmd(self, deadline: float) -> None:
        if self.peer is not None:  # the first node's epmd
            return
        if self.epmd_proc is not None and self.epmd_proc.poll() is None:
            return
        with open(self.log_dir / "epmd.log", "ab") as out:
            self.epmd_proc = subprocess.Popen(
                [self.epmd_executable, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                **self._popen_kwargs(),
            )
        while not _port_open(self.epmd_port):
            if self.epmd_proc.poll() is not None or time.monotonic() > deadline:
                log = _tail(self.log_dir / "epmd.log")
                self._stop_epmd()
                raise RuntimeError(f"epmd did not start on 127.0.0.1:{self.epmd_port}: {log}")
            time.sleep(0.02)

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        assert self.proc is not None
        stage = "AMQP handshake"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"rabbitmq-server exited with {self.proc.returncode} "
                    f"before it was ready:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rabbitmq-server {self.nodename} not ready ({stage}) on port "
                    f"{self.port} within {timeout}s:\n{self.log_tail()}"
                )
            if stage == "AMQP handshake" and self.amqp_handshake():
                stage = "check_running"
            if stage == "check_running":
                remaining = max(1.0, deadline - time.monotonic())
                if self._check_running(timeout=remaining):
                    stage = "AMQP login"
                else:
                    time.sleep(0.2)
            if stage == "AMQP login":
                if self.ping():
                    return
                time.sleep(0.2)
            else:
                time.sleep(0.1)

    def amqp_handshake(self) -> bool:
        """True if something answers the AMQP 0-9-1 header with a Connection.Start frame."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(_AMQP_HEADER)
                # frame type 1 (method), channel 0, ..., class 10 (connection), method 10 (start)
                frame = sock.recv(11)
                return len(frame) >= 11 and frame[0] == 1 and frame[7:11] == b"\x00\x0a\x00\x0a"
        except OSError:
            return False

    def ping(self) -> bool:
        """True if ``guest`` can open an AMQP connection and a channel."""
        from kombu.connection import Connection

        try:
            with Connection(self.url, connect_timeout=2) as conn:  # type: ignore[no-untyped-call, unused-ignore]
                conn.connect()
                conn.default_channel  # noqa: B018 - opens a channel
            return True
        except Exception:
            return False

    def _check_running(self, timeout: float) -> bool:
        try:
            result = self.ctl(
                "rabbitmq-diagnostics", "-q", "check_running", timeout=min(timeout, 30.0)
            )
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def ctl(self, tool: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a RabbitMQ CLI tool (``rabbitmqctl``, ``rabbitmq-diagnostics``, ...) on the node.

        The tool gets ``-n NODE`` and the node's environment (cookie, epmd
        port); its own distribution listener is on loopback too.
        """
        env_kwargs = self._popen_kwargs()
        env_kwargs["env"] = dict(env_kwargs["env"])
        ctl_port = free_port()
        env_kwargs["env"].update(
            RABBITMQ_CTL_DIST_PORT_MIN=str(ctl_port), RABBITMQ_CTL_DIST_PORT_MAX=str(ctl_port)
        )
        return subprocess.run(
            [str(self.bin_dir / tool), "-n", self.nodename, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **env_kwargs,
        )

    def stop(self, *, kill: bool = False) -> None:
        """Stop the node (SIGTERM: clean shutdown; ``kill=True``: SIGKILL) and its epmd.

        Only the process group started by :meth:`start` and the private epmd
        are signalled.
        """
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                if kill:
                    _killpg(proc.pid, signal.SIGKILL)
                else:
                    # The script traps SIGTERM and forwards it to the Erlang VM,
                    # which then shuts RabbitMQ down cleanly.
                    proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    _killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            # Nothing of ours may linger (beam.smp, erl_child_setup, inet_gethost).
            _killpg(proc.pid, signal.SIGKILL)
        self._stop_epmd()

    def _stop_epmd(self) -> None:
        proc, self.epmd_proc = self.epmd_proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        _killpg(proc.pid, signal.SIGKILL)

    def restart(self, *, kill: bool = False, timeout: float = 90.0) -> None:
        """Stop and start again on the same ports, node name and data directory."""
        self.stop(kill=kill)
        self.start(timeout=timeout)

    def close(self) -> None:
        """Stop the node and delete its temporary directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the node log and of the start script's output, for error messages."""
        parts = []
        for name in ("rabbit.log", "startup_log", "startup_err"):
            text = _tail(self.log_dir / name, chars)
            if text.strip():
                parts.append(f"--- {name} ---\n{text}")
        return "\n".join(parts) or "(no log output)"

    @property
    def pid(self) -> int | None:
        """The node's process id (from its pid file), None before the node wrote it."""
        try:
            return int((self.dir / "mnesia" / f"{self.nodename}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def __enter__(self) -> RabbitMQServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RabbitMQCluster:
    """``size`` private RabbitMQ nodes on loopback joined into one cluster.

    The nodes share the first node's epmd and Erlang cookie; each other node is
    stopped as an application, joined to the first (``rabbitmqctl join_cluster``)
    and started again, as an operator builds a cluster.  :attr:`url` lists every
    node for Kombu's failover (``amqp://...;amqp://...``).
    """

    def __init__(self, size: int = 3) -> None:
        if size < 2:
            raise ValueError(f"a cluster has at least 2 nodes, not {size}")
        first = RabbitMQServer()
        self.nodes = [first, *(RabbitMQServer(peer=first) for _ in range(size - 1))]

    @property
    def url(self) -> str:
        """Every node's AMQP URL, ``;``-separated: Kombu tries them in turn."""
        return ";".join(node.url for node in self.nodes)

    def start(self, timeout: float = 90.0) -> RabbitMQCluster:
        """Start the nodes and join them; return once the first lists them all running."""
        first = self.nodes[0]
        try:
            first.start(timeout=timeout)  # with the epmd the others register in
            with ThreadPoolExecutor(len(self.nodes) - 1) as pool:
                for started in [pool.submit(n.start, timeout) for n in self.nodes[1:]]:
                    started.result()
            for node in self.nodes[1:]:
                for args in (("stop_app",), ("join_cluster", first.nodename), ("start_app",)):
                    done = node.ctl("rabbitmqctl", *args, timeout=timeout)
                    if done.returncode != 0:
                        raise RuntimeError(
                            f"rabbitmqctl {' '.join(args)} on {node.nodename} failed: "
                            f"{done.stdout}{done.stderr}\n{node.log_tail()}"
                        )
            running = self.running()
            if running != {n.nodename for n in self.nodes}:
                raise RuntimeError(f"cluster of {[n.nodename for n in self.nodes]}: {running}")
        except BaseException:
            self.close()
            raise
        return self

    def running(self) -> set[str]:
        """The nodes the first node's ``cluster_status`` says are running."""
        done = self.nodes[0].ctl("rabbitmqctl", "cluster_status", "--formatter", "json")
        if done.returncode != 0:
            return set()
        return set(json.loads(done.stdout).get("running_nodes", []))

    def close(self) -> None:
        """Stop every node (the first, which runs epmd, last) and delete their directories."""
        for node in reversed(self.nodes):
            node.close()

    def __enter__(self) -> RabbitMQCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _killpg(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group ``pgid`` (a session we started), if anything is left in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
