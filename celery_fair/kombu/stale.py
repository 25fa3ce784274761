"""CoDel on the buffered messages of :class:`~celery_fair.kombu.mixin.FairConsumerMixin`.

A message's sojourn is the time since the consumer received it.  The
admission loop (:func:`~celery_fair.scheduling.dispatch.next_admitted`)
asks :class:`StaleMessages` about each message it takes; a stale one is
sent back to the broker (:func:`~celery_fair.kombu.requeue.requeue`) or,
when that fails, handled here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from .. import compat
from ..scheduling.dispatch import DispatchRound, SendBack, next_admitted
from ..scheduling.shedding import SheddingPolicy
from .fill import Buffered
from .requeue import requeue, requeue_count

__all__ = ("StaleMessages", "admission", "hold_fetch_while_dropping")


class StaleMessages:
    """The CoDel check and send-back of the admission loop, under ``policy``."""

    def __init__(self, policy: SheddingPolicy, *, log: logging.Logger) -> None:
        self._policy = policy
        self._log = log

    def check(self, name: str, item: Buffered, backlog: int) -> SendBack | None:
        """The admission loop's CoDel check (see :func:`next_admitted`)."""
        _, message, received = item
        return self._policy.check(
            name, received, backlog, partial(requeue_count, message.headers), destination=name
        )

    def send_back(self, name: str, item: Buffered, back: SendBack) -> bool:
        """Send a stale message back: True if it left, False to handle it here."""
        message = item[1]
        if requeue(
            message, back, log=self._log,
            failure="CoDel could not return a message of queue %r; handling it here", args=(name,),
        ):  # fmt: skip
            return True
        if message.acknowledged:
            return True  # acked anyway: the copy is out
        self._policy.failed(name, back)
        return False


def admission(
    buffer: DispatchRound[Buffered],
    lock: AbstractContextManager[Any],
    policy: SheddingPolicy | None,
    *,
    hold: Callable[[Buffered | None], None],
    log: logging.Logger,
) -> Callable[[], tuple[str, Buffered] | None]:
    """The next message of ``buffer`` in DWRR order that CoDel lets run (all, when off).

    ``hold(item)`` is told the message in hand, as :func:`next_admitted` says.
    """
    if policy is None:
        return partial(next_admitted, buffer, lock, (), _handle_here, hold=hold)
    stale = StaleMessages(policy, log=log)
    return partial(
        next_admitted, buffer, lock, [stale.check], stale.send_back, empty=policy.empty, hold=hold
    )


def _handle_here(name: str, item: Buffered, back: SendBack) -> bool:
    # Without a check nothing is sent back; next_admitted still wants the callable.
    return False


def hold_fetch_while_dropping(
    channel: Any, policy: SheddingPolicy, buffer: DispatchRound[Buffered]
) -> None:
    """Fetch nothing more on ``channel`` while CoDel drops and messages are buffered."""
    # RabbitMQ pushes, and its returned copies join the back of the queue.
    compat.hold_fetch_while(getattr(channel, "qos", None), lambda: policy.dropping and bool(buffer))
