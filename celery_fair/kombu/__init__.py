"""The Kombu pieces: the DWRR queue cycle and FairConsumerMixin."""

from __future__ import annotations

from .mixin import FairConsumerMixin, FairConsumerStatistics, FairQueueStatistics

__all__ = ("FairConsumerMixin", "FairConsumerStatistics", "FairQueueStatistics")
