"""Small process and polling helpers: a free loopback port, stopping a child, polling."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

__all__ = ("free_port", "poll_until", "stop_process")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes] | None, *, kill: bool = False) -> None:
    """Stop a process we started (SIGTERM, or SIGKILL with ``kill``), and reap it.

    A process that does not exit within 10 s of SIGTERM is killed.
    """
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


def poll_until(condition: Callable[[], object], timeout: float, every: float = 0.05) -> bool:
    """Poll ``condition`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
