"""The errors celery-fair raises, at the bottom of the package: every layer may raise them."""

from __future__ import annotations

__all__ = ("CompatibilityError", "FairConfigError", "KeyBacklogFull")


class FairConfigError(ValueError):
    """A ``fair_*`` setting, a ``--fair-*`` option or a command argument has an invalid value.

    The message names the setting and the value.  When ``celery worker``
    starts, the worker's steps turn it into Celery's one-line ``Error: ...``
    (:class:`celery_fair.worker.steps.StartError`) and the worker exits with
    status 1.
    """


class CompatibilityError(FairConfigError):
    """A capability celery-fair cannot do without is missing from these versions.

    Raised by the start-up probes of :mod:`celery_fair.compat`, naming the
    versions of Celery, Kombu and redis-py in use.
    """


class KeyBacklogFull(Exception):
    """A publish refused: the key already has its cap of messages waiting.

    Raised in the producer by ``apply_async`` for a keyed queue on Redis when
    ``fair_key_max_backlog`` caps the key and its backlog (messages waiting in
    the queue, all priority levels and users together; running tasks are not
    counted) has reached the cap.  Nothing was written: the caller may retry
    later, shed the work or tell its user.
    """

    def __init__(self, queue: str, key: str, cap: int, backlog: int) -> None:
        self.queue, self.key, self.cap, self.backlog = queue, key, cap, backlog
        super().__init__(
            f"key {key!r} of queue {queue!r} has {backlog} messages waiting, at its "
            f"fair_key_max_backlog cap of {cap}: the message was not published"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, int, int]]:
        return type(self), (self.queue, self.key, self.cap, self.backlog)
