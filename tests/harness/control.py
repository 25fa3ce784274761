"""A remote-control client for the workers of the tests, benchmarks and demo.

Celery caches an app's connection pool with the broker URL it first saw, so
pointing a shared app at another broker (``app.conf.broker_url = ...``) makes
its broadcasts go to the old one.  Each client here is a fresh app.
"""

from __future__ import annotations

from typing import Any

__all__ = ("broadcast_until_replied", "control_app", "fair_stats", "wait_fair_stats")


def control_app(broker_url: str) -> Any:
    """A throw-away Celery app on ``broker_url``, for ``app.control``."""
    from celery import Celery

    return Celery("celery_fair_control", broker=broker_url, set_as_current=False)


def fair_stats(broker_url: str, *, timeout: float = 2.0, limit: int | None = 1) -> dict[str, Any]:
    """``inspect fair_stats`` replies by worker name (empty if none came)."""
    app = control_app(broker_url)
    try:
        return app.control.inspect(timeout=timeout, limit=limit)._request("fair_stats") or {}
    finally:
        app.close()


def wait_fair_stats(broker_url: str, *, timeout: float = 30.0) -> dict[str, Any]:
    """The first worker's ``fair_stats``, asking until one replies within ``timeout`` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replies = fair_stats(broker_url, timeout=2.0)
        if replies:
            return next(iter(replies.values()))
    raise AssertionError(f"no fair_stats reply within {timeout:g} s")


def broadcast_until_replied(app: Any, command: str, **arguments: Any) -> list[dict[str, Any]]:
    """Broadcast ``command`` from ``app`` until a worker replies (one may still be
    starting), for up to 30 s; no reply may be an error."""
    import time

    deadline = time.monotonic() + 30
    while True:
        replies = app.control.broadcast(command, arguments=arguments, reply=True, timeout=2)
        if replies:
            assert not any("error" in r for reply in replies for r in reply.values()), replies
            return list(replies)
        assert time.monotonic() < deadline, f"no reply to {command}"
