"""Key-slot releases on their way to the broker (per-key limits).

A task of a limited key holds its key's slot on the broker (a lease) until
the worker releases it.  :class:`ReleaseOutbox` keeps every release until
the broker has run it: it rides on the next fetch when one follows, else it
goes in a round trip of its own; one that may not have arrived (no sender
yet, a failed send, a connection lost under the fetch that carried it) is
sent again when a sender is attached.

A release made on another thread than the fetch's (a thread pool's, a
greenlet's) rides on the next fetch while the fetch is busy (the carry is
open: the fetch thread opens it with each fetch it sends and closes it,
flushing what waits, before it waits for work).  A release the next fetch
did not take within a tick of the worker's timer goes on its own: the fetch
may not follow soon (the prefetch window full, the fetch held back), and a
slot must not stay held for that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ("ReleaseCarrier", "ReleaseOutbox", "Sender")

logger = logging.getLogger(__name__)

#: Releases kept to send again at the next connection, at most (a worker holds
#: about one per pool slot; the oldest go first, their leases expire).
MAX_UNSENT_RELEASES = 10_000

#: Seconds between two looks for releases no fetch took (see :meth:`ReleaseOutbox.flush_if_stuck`):
#: a release waits for a fetch at most about twice this.
CARRY_CHECK = 0.05

#: Sends ``(queue, delivery tag)`` releases to the broker; with ``wake`` true it
#: also ends the worker's idle fetch, in the same round trip.
Sender = Callable[[list[tuple[str, str]], bool], None]


class ReleaseCarrier(Protocol):
    """The fetch a release can ride on (:class:`~celery_fair.kombu.atomic.AtomicFetch`)."""

    def will_fetch(self) -> bool:
        """Whether a fetch follows on this thread that can carry a release."""

    def wake(self, pipe: Any = None) -> None:
        """End the fetch's idle wait."""


class ReleaseOutbox:
    """The releases of one worker, from the finished task to the broker's reply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sender: Sender | None = None
        self._fetch: ReleaseCarrier | None = None
        #: Releases waiting for the next fetch to carry them.
        self._waiting: list[tuple[str, str]] = []
        #: Releases carried by the fetch in flight, until its reply arrives.
        self._carried: list[tuple[str, str]] = []
        #: Releases that may not have reached the broker: sent when a sender is attached.
        self._unsent: list[tuple[str, str]] = []
        #: Whether a release made on another thread may wait for the next fetch.
        self._carry_open = False
        #: Fetches that took the waiting releases, and that count at the last look.
        self._takes = self._takes_seen = 0
        self.released = self.errors = 0

    @property
    def unsent(self) -> int:
        """Releases waiting for the next connection to be sent again."""
        return len(self._unsent)

    def attach(self, sender: Sender) -> int:
        """Send releases with ``sender`` from now on (a connection's): first the ones
        the broker may not have had, which would otherwise hold their keys' slots
        until their leases expire.  Returns how many of those were sent again.

        A release the broker had already run finds no lease and frees nothing,
        so sending one twice is harmless.  Sent again rather than left to the
        leases' expiry (``lease_ttl``, by default the visibility timeout, an
        hour): until then a key's slot would stay held after every broker
        restart or failover that broke a release.
        """
        self._sender = sender
        with self._lock:
            releases, self._unsent = self._unsent, []
        if releases:
            self.send(releases)
        return len(releases)

    def fetched_by(self, fetch: ReleaseCarrier | None) -> None:
        """Releases ride on ``fetch`` (a channel's) when it follows, and wake it when it idles."""
        self._fetch = fetch

    def release(self, queue: str, tag: str, *, wake: bool) -> None:
        """Release the key slot of message ``tag`` of ``queue``: with the next fetch if one
        follows on this thread, else now (``wake``: ending the idle fetch too)."""
        # A finished task's release rides on the next fetch when one follows on
        # this thread (the pool's results come on the worker's loop, as prefork's
        # and solo's do): the pool slot then waits for one round trip, the fetch,
        # not three (the release, the idle fetch's wake-up, the fetch).
        fetch = self._fetch
        if fetch is not None and fetch.will_fetch():
            with self._lock:
                self._waiting.append((queue, tag))
            return
        with self._lock:
            # Another thread's release, while the fetch is busy: the fetch
            # thread takes it, or flushes it before it waits (same lock).
            if self._carry_open:
                self._waiting.append((queue, tag))
                return
        self.send([(queue, tag)], wake=wake)

    def open_carry(self) -> None:
        """The fetch thread sent a fetch: other threads' releases may wait for the next."""
        with self._lock:
            self._carry_open = True

    def take(self) -> list[tuple[str, str]]:
        """The releases to carry on the fetch being sent, ``(queue, delivery tag)``.

        Counted as released; kept until :meth:`confirm` (the fetch's reply),
        so that a connection lost under the fetch sends them again.
        """
        with self._lock:
            releases, self._waiting = self._waiting, []
            self.released += len(releases)
            self._carried.extend(releases)
            self._takes += 1
        return releases

    def confirm(self) -> None:
        """The fetch that carried releases has its reply: the broker ran them."""
        if self._carried:
            with self._lock:
                self._carried.clear()

    def flush(self) -> None:
        """Send the releases waiting for a fetch now (no fetch follows soon); other
        threads' releases go at once until the next fetch is sent."""
        with self._lock:
            self._carry_open = False
            releases, self._waiting = self._waiting, []
        if releases:
            self.send(releases)

    def flush_if_stuck(self) -> None:
        """The worker's timer, every :data:`CARRY_CHECK` s: send the releases that waited
        since the last look with no fetch to take them."""
        with self._lock:
            stuck = bool(self._waiting) and self._takes == self._takes_seen
            self._takes_seen = self._takes
        if stuck:
            self.flush()

    def send(self, releases: list[tuple[str, str]], wake: bool = False) -> None:
        """Free these key slots in a round trip of their own; ``wake`` ends an idle fetch.

        Without a sender (before the first connection's settings are written)
        or when the send fails, they are kept for :meth:`attach`, never dropped
        to wait for the leases' expiry.
        """
        send = self._sender
        if send is None:
            if wake:
                self.wake_fetch()
            self._keep(releases)
            return
        try:
            send(releases, wake)
        except Exception as exc:  # sent again at the next connection: never fatal
            if wake:
                self.wake_fetch()  # the fetch must not wait for its timeout as well
            with self._lock:
                self.errors += len(releases)
            self._keep(releases)
            logger.warning(
                "celery-fair: could not release the key slot of message(s) %s (%r); "
                "sent again at the next connection",
                ", ".join(tag for _, tag in releases), exc,
            )  # fmt: skip
            return
        with self._lock:
            self.released += len(releases)

    def wake_fetch(self) -> None:
        """A limited queue has room again: end the fetch's idle wait, if it has one."""
        fetch = self._fetch
        if fetch is not None:
            fetch.wake()

    def lost(self, running: list[tuple[str, str]]) -> None:
        """A new channel: releases carried by a fetch whose reply never came, or still
        waiting for a fetch, go at the next :meth:`attach`; so do ``running``, the
        slots of tasks the pool will never report finished."""
        with self._lock:
            lost = self._carried + self._waiting
            self._carried, self._waiting = [], []
        self._keep(lost + running)

    def _keep(self, releases: list[tuple[str, str]]) -> None:
        with self._lock:
            self._unsent.extend(releases)
            del self._unsent[:-MAX_UNSENT_RELEASES]
