"""Find workers without celery-fair that consume a keyed queue, and say so loudly.

A worker without celery-fair polls only the queue's own Kombu list: it runs
the messages published without a key and never sees the keyed ones.  Nothing
is lost (celery-fair workers serve them), but a deployment half upgraded
would silently leave keyed work to fewer workers.  When a celery-fair worker
starts it asks every worker, by remote control, which queues it consumes
(``inspect active_queues``) and whether it runs celery-fair (``inspect
fair_stats``), and logs an error naming each worker that consumes a keyed
queue without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ("ask_plain_consumers", "plain_consumers", "warn_about_plain_consumers")

logger = logging.getLogger(__name__)


def plain_consumers(
    active_queues: Mapping[str, Any], fair_stats: Mapping[str, Any], keyed: Collection[str]
) -> dict[str, list[str]]:
    """Workers that consume a keyed queue and did not answer ``fair_stats`` as celery-fair.

    ``active_queues`` and ``fair_stats`` are the replies of ``inspect``, by
    worker name.  A worker whose ``fair_stats`` reply is missing or an error
    counts as one without celery-fair.
    """
    found: dict[str, list[str]] = {}
    for worker, queues in active_queues.items():
        consumed = {str(q.get("name")) for q in queues or () if isinstance(q, Mapping)}
        names = sorted(consumed & set(keyed))
        if not names:
            continue
        stats = fair_stats.get(worker)
        if isinstance(stats, Mapping) and "error" not in stats and "cost" in stats:
            continue
        found[worker] = names
    return found


def _fair_stats(
    control: Any, connection: Any, timeout: float, destination: list[str] | None = None
) -> dict[str, Any]:
    """Each answering worker's ``fair_stats`` reply, by worker name."""
    stats: dict[str, Any] = {}
    replies = control.broadcast(
        "fair_stats", reply=True, timeout=timeout, connection=connection, destination=destination
    )
    for reply in replies or ():
        stats.update(reply)
    return stats


def ask_plain_consumers(
    app: Any, keyed: Collection[str], *, timeout: float = 2.0
) -> dict[str, list[str]]:
    """Ask the cluster by remote control: workers consuming a keyed queue without celery-fair.

    The replies are collected on a connection of this call's own, closed
    before it returns, never on one of the app's pool.  On Redis the
    collection ends with a poll of the reply queue in flight; a pooled
    connection would keep it, and every prefork child forked later closes
    the pool's connections (Kombu's after-fork cleanup), reading that poll's
    reply from the socket it shares with its parent: the first child takes
    it, each later one waits for ever, and the worker stops running tasks
    once ``--max-tasks-per-child`` or autoscale forks again.
    """
    with app.connection_for_read() as connection:
        control = app.control
        active = control.inspect(timeout=timeout, connection=connection).active_queues() or {}
        stats = _fair_stats(control, connection, timeout)
        # A worker busy starting may answer a round late: the silent ones are
        # asked once more before they count as plain.
        silent = [w for w in plain_consumers(active, stats, keyed) if w not in stats]
        if silent:
            stats.update(_fair_stats(control, connection, timeout, destination=silent))
    return plain_consumers(active, stats, keyed)


def warn_about_plain_consumers(
    app: Any,
    keyed: Collection[str],
    *,
    timeout: float = 2.0,
    log: Callable[..., None] = logger.error,
) -> threading.Thread:
    """Ask the cluster once, from a daemon thread, and log each plain consumer found."""

    def run() -> None:
        try:
            found = ask_plain_consumers(app, keyed, timeout=timeout)
        except Exception as exc:  # the check must never take the worker down
            logger.debug("celery-fair: could not ask the workers for their queues: %r", exc)
            return
        for worker, queues in sorted(found.items()):
            log(
                "celery-fair: worker %s consumes the keyed queue(s) %s without celery-fair: "
                "it sees only messages published without a key, never the keyed ones. "
                "Install celery-fair there (celery_fair.install(app)) or stop it consuming %s.",
                worker, ", ".join(queues), ", ".join(queues),
            )  # fmt: skip

    thread = threading.Thread(target=run, name="celery-fair-keyed-consumers", daemon=True)
    thread.start()
    return thread
