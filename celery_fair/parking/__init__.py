"""Parked messages: kept on the broker with a reason instead of dropped.

See :mod:`celery_fair.parking.records` for what is kept, and
:mod:`celery_fair.parking.store` for where, on each broker.
"""

from .records import PARKING_SUFFIX, ParkedMessage, parking_queue

__all__ = ("PARKING_SUFFIX", "ParkedMessage", "parking_queue")
