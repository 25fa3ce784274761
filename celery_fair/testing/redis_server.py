"""A throw-away ``redis-server`` on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from .processes import free_port, stop_process

__all__ = ("RedisServer",)

_S = TypeVar("_S", bound="RedisServer")


class RedisServer:
    """Run ``redis-server`` in a temporary directory, bound to 127.0.0.1 only.

    ``executable``: the server binary, a name looked up on ``PATH`` (and in
    ``/usr/bin:/usr/sbin``) or a path.  ``port``: default a free one.  Nothing
    is persisted (no RDB, no AOF).  Use it as a context manager, or call
    :meth:`start` and :meth:`close`.
    """

    def __init__(self, *, port: int | None = None, executable: str = "redis-server") -> None:
        exe = shutil.which(executable) or shutil.which(executable, path="/usr/bin:/usr/sbin")
        if exe is None:
            raise RuntimeError(f"{executable!r} not found on PATH")
        self.executable = exe
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """The server binary's name (``redis-server``, ``valkey-server``)."""
        return Path(self.executable).name

    @property
    def url(self) -> str:
        """The broker URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def arguments(self) -> list[str]:
        """The server's command line (a subclass adds its options here)."""
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip

    def start(self: _S, timeout: float = 10.0) -> _S:
        """Start the server and wait (polling, ``timeout`` s at most) until it answers."""
        self.proc = subprocess.Popen(
            self.arguments(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on port {self.port} in {timeout}s")

    def log(self) -> str:
        """The end of the server's log file."""
        path = self.dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def ping(self) -> bool:
        """Whether the server answers (a refusal for want of a password is an answer)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server process (by its PID), keeping its directory."""
        proc, self.proc = self.proc, None
        stop_process(proc, kill=kill)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
