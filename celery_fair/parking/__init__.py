from ..parked import PARKING_SUFFIX, ParkedMessage, parking_queue

"""Parked messages: kept on the broker with a reason instead of dropped.

See :mod:`celery_fair.parked` for what is kept, and
:mod:`celery_fair.parking.store` for where, on each broker.
"""


__all__ = ("PARKING_SUFFIX", "ParkedMessage", "parking_queue")
