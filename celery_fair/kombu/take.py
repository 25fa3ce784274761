"""Many messages of one Redis queue per round trip, each recorded as unacknowledged.

:class:`~celery_fair.kombu.mixin.FairConsumerMixin` keeps each queue's buffer
as full as its window allows.  Kombu's own ``Queue.get`` costs two round trips
per message (the pop, then the unacked record, as Kombu's BRPOP path); the
``TAKE`` script (lua/take.lua) pops as many as the window has room for and
records each one in the same step, so a crash leaves every message in its
queue or in the unacked index, as the worker's atomic fetch does.

Every private part of Kombu it uses goes through :mod:`celery_fair.compat`.
"""

from __future__ import annotations

import logging
from time import time
from typing import Any

from kombu.message import Message
from kombu.serialization import prepare_accept_content
from kombu.utils.json import loads

from .. import compat
from ..keys.scripts import TAKE
from ..keys.store import text
from ..parked import NOT_A_MESSAGE, PARKED_LOG, PARKING_SUFFIX

__all__ = ("Take",)

logger = logging.getLogger(__name__)


class Take:
    """Takes messages of queue ``name`` on a Kombu Redis ``channel`` for its consumer."""

    def __init__(self, channel: Any, name: str, accept: Any = None) -> None:
        self.channel = channel
        self.name = name
        prefix = compat.key_prefix(channel)
        steps = compat.priority_steps(channel)
        lists = [prefix + compat.queue_key(channel, name, step) for step in steps]
        self._keys = [
            *lists,
            prefix + name + PARKING_SUFFIX,
            *(prefix + key for key in compat.unacked_keys(channel)),
        ]
        self._lists = len(lists)
        self._append = compat.unrecorded_append(channel.qos)
        self._accept = None if accept is None else prepare_accept_content(accept)

    def __call__(self, count: int) -> list[Message]:
        """Up to ``count`` messages, in the order Kombu would get them (fewer: the queue
        ran dry), delivered to the channel's QoS as unacknowledged."""
        with compat.redis_client(self.channel) as client:
            taken, parked = TAKE(client, self._lists, repr(time()), count, *self._keys)
        if parked:
            logger.error(
                PARKED_LOG, self.name, self.name + PARKING_SUFFIX, f"{parked} x {NOT_A_MESSAGE}"
            )
        messages = []
        for raw in taken:
            message = self.channel.message_to_python(loads(text(raw)))
            self._append(message, message.delivery_tag)
            message.accept = self._accept
            messages.append(message)
        return messages
