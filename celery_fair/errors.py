"""The errors celery-fair raises, at the bottom of the package: every layer may raise them."""

from __future__ import annotations

__all__ = (
    "BrokerMemoryHigh",
    "CompatibilityError",
    "FairConfigError",
    "FairConfigWarning",
    "KeyBacklogFull",
    "PublishRefused",
)


class FairConfigError(ValueError):
    """A ``fair_*`` setting, a ``--fair-*`` option or a command argument has an invalid value.

    The message names the setting and the value.  When ``celery worker``
    starts, the worker's steps turn it into Celery's one-line ``Error: ...``
    (:class:`celery_fair.worker.steps.StartError`) and the worker exits with
    status 1.
    """


class FairConfigWarning(UserWarning):
    """A ``fair_*`` setting a worker would refuse, or one celery-fair does not know.

    Issued by :func:`celery_fair.install` in any process, a producer
    included, where settings are otherwise checked only when a worker
    starts: the app still boots.  Filter it as any warning:
    ``warnings.simplefilter("error", FairConfigWarning)`` (or pytest's
    ``filterwarnings = ["error::celery_fair.FairConfigWarning"]``) turns it
    into an error, ``"ignore"`` silences it.  Python's ``-W`` cannot name it:
    the option is read before any package can be imported.
    """


class CompatibilityError(FairConfigError):
    """A capability celery-fair cannot do without is missing from these versions.

    Raised by the start-up probes of :mod:`celery_fair.compat`, naming the
    versions of Celery, Kombu and redis-py in use.
    """


class PublishRefused(Exception):
    """A publish refused by the producer: nothing was written.

    The base of :class:`KeyBacklogFull` (a key's own cap) and
    :class:`BrokerMemoryHigh` (admission before the broker fills): catch it
    to retry later, shed the work or tell the user, whichever refused it.
    """


class KeyBacklogFull(PublishRefused):
    """A publish refused: the key already has its cap of messages waiting.

    Raised in the producer by ``apply_async`` for a keyed queue when
    ``fair_key_max_backlog`` caps the key and its backlog (messages waiting in
    the queue, all priority levels and users together; running tasks are not
    counted) has reached the cap: on Redis counted by the push script, on
    RabbitMQ in the key's counter (:mod:`celery_fair.keys.backlog_counter`).
    Nothing was written: the caller may retry later, shed the work or tell
    its user.
    """

    def __init__(self, queue: str, key: str, cap: int, backlog: int) -> None:
        self.queue, self.key, self.cap, self.backlog = queue, key, cap, backlog
        super().__init__(
            f"key {key!r} of queue {queue!r} has {backlog} messages waiting, at its "
            f"fair_key_max_backlog cap of {cap}: the message was not published"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, int, int]]:
        return type(self), (self.queue, self.key, self.cap, self.backlog)


class BrokerMemoryHigh(PublishRefused):
    """A publish refused because the broker is nearly full (``fair_broker_memory_high``).

    Raised in the producer by ``apply_async`` on Redis when the broker's memory
    is above ``fair_broker_memory_high`` of its ``maxmemory`` and the message's
    backlog (its key's, in a keyed queue; ``key`` is then set, else its
    queue's) is among the largest: at least ``ceiling`` messages waiting.
    Above ``fair_broker_memory_hard`` the ceiling is 0: every publish is
    refused.  ``used`` and ``maxmemory`` are the broker's, in bytes, as last
    read.  Nothing was written.
    """

    def __init__(
        self, queue: str, key: str | None, backlog: int, ceiling: int, used: int, maxmemory: int
    ) -> None:
        self.queue, self.key, self.backlog, self.ceiling = queue, key, backlog, ceiling
        self.used, self.maxmemory = used, maxmemory
        share = f"{used / maxmemory:.0%}" if maxmemory else "?"
        whose = f"key {key!r} of queue {queue!r}" if key is not None else f"queue {queue!r}"
        if ceiling == 0:
            why = "over fair_broker_memory_hard: every publish is refused"
        else:
            why = (
                f"over fair_broker_memory_high: {whose} has {backlog} messages waiting, "
                f"among the largest backlogs (refused from {ceiling})"
            )
        super().__init__(
            f"the broker uses {share} of its maxmemory ({used} of {maxmemory} bytes), "
            f"{why}: the message for {whose} was not published"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str | None, int, int, int, int]]:
        return type(self), (
            self.queue, self.key, self.backlog, self.ceiling, self.used, self.maxmemory,
        )  # fmt: skip
