"""A throw-away ``redis-server`` on a free loopback port, for tests and the demo."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ("RedisSentinel", "RedisServer", "free_port", "stop_process")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes] | None, *, kill: bool = False) -> None:
    """Stop a server process we started (SIGTERM, or SIGKILL with ``kill``), and reap it."""
    if proc is None or proc.poll() is not None:
        return
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class RedisServer:
    """Run ``redis-server`` in a temporary directory, bound to loopback only.

    ``appendonly`` turns on AOF persistence (``appendfsync always``) so a
    restart on the same directory keeps the data; ``restart()`` reuses the
    port, as a broker restarted by an operator would.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        executable: str = "redis-server",
    ) -> None:
        exe = shutil.which(executable) or shutil.which(executable, path="/usr/bin:/usr/sbin")
        if exe is None:
            raise RuntimeError(
                f"{executable!r} not found: run `make setup` (it installs the Debian "
                "package redis-server)"
            )
        self.executable = exe
        self.port = port or free_port()
        self.appendonly = appendonly
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.dir / "redis.log"),
            "--daemonize",
            "no",
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, kill=kill)

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RedisSentinel:
    """Run ``redis-sentinel`` on a free loopback port, monitoring ``master``.

    The sentinel names the master ``master_name``; Kombu reaches it with a
    ``sentinel://127.0.0.1:<port>`` URL and the transport option
    ``master_name``.
    """

    def __init__(self, master: RedisServer, *, master_name: str = "fair-master") -> None:
        exe = shutil.which("redis-sentinel") or shutil.which(
            "redis-sentinel", path="/usr/bin:/usr/sbin"
        )
        if exe is None:
            raise RuntimeError(
                "'redis-sentinel' not found: run `make setup` (it installs the Debian "
                "package redis-sentinel)"
            )
        self.executable = exe
        self.master = master
        self.master_name = master_name
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
            f"sentinel down-after-milliseconds {self.master_name} 5000\n"
        )
        self.proc = subprocess.Popen(
            [self.executable, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "sentinel.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-sentinel exited with {self.proc.returncode}: {log}")
            if self._knows_master():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-sentinel did not report its master in {timeout}s")

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
