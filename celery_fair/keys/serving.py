"""The worker's side of keyed queues: fetch charges, run-time corrections, counts.

One :class:`KeyedServing` per worker, shared by the atomic fetch (which asks
what to charge and reports each key it served) and the task tracker (which
reports run times).  Run-time corrections are not sent one by one: they ride
on the next fetch script call, so ``fair_cost="runtime"`` costs no extra
round trip.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..scheduling.estimate import Ewma
from ..wire.served import Served
from .layout import UNKEYED
from .limits import KeyLimits

__all__ = ("KeyStatistics", "KeyedServing")

logger = logging.getLogger(__name__)

#: Served-key counts kept per worker for ``inspect fair_stats`` (the top
#: keys); past this many distinct keys the counts are halved and the
#: smallest dropped (a bounded heavy-hitters summary).
COUNTED_KEYS = 1024

_RUNNING, _FINISHED, _SETTLED = "running", "finished", "settled"
_UNKNOWN: tuple[str | None, str | None] = (None, None)

#: Corrections kept while no fetch runs to carry them (oldest dropped first).
MAX_PENDING_CHARGES = 10_000
#: Releases kept to send again at the next connection, at most (a worker holds
#: about one per pool slot; the oldest go first, their leases expire).
MAX_UNSENT_RELEASES = 10_000

#: Seconds. While a limited queue's tasks take less than this on average, a
#: worker fetches one task beyond its pool slots. Without it a pool slot waits,
#: after every task, for the release and the fetch of the next one: 13-18% of
#: the throughput with 10 ms tasks, 37-41% with no-op tasks (bench.key_limits).
#: The task fetched ahead holds its key's slot while it waits, at most about
#: one task length: below this, that wait is short; above it, the round trip
#: is a small part of a task and the slot is better left to other workers.
LOOKAHEAD_BELOW = 0.1


@dataclass(frozen=True)
class KeyStatistics:
    """What one worker served from its keyed queues."""

    queues: tuple[str, ...]
    default_weight: float
    cost: str
    #: Messages served per keyed queue.
    served: dict[str, int]
    #: Of those, messages without a key (a plain producer's, or one whose key
    #: was missing at publish), per keyed queue.
    unkeyed: dict[str, int]
    #: The most served keys, ``(queue, key, count)``, most first.
    top: tuple[tuple[str, str, int], ...]
    pending_charges: int
    #: Per-key limits as configured (``"*"``: every other key); live changes
    #: are on the broker (``inspect fair_stats`` reads them there).
    concurrency: dict[str, int]
    rates: dict[str, float]
    lease_ttl: float
    #: Slots released by this worker (tasks finished, revoked, returned), and
    #: releases that failed (sent again at the next connection; a lease whose
    #: release never arrives expires after ``lease_ttl``).
    released: int
    release_errors: int
    #: Releases waiting for the next connection to be sent again.
    unsent_releases: int


class KeyedServing:
    """Keyed queues on one worker.

    ``estimate(queue)`` is the charge at fetch in run-time mode (the
    worker's moving average of the queue's run time); in count mode every
    message is charged 1 and nothing is corrected.
    """

    def __init__(
        self,
        queues: Iterable[str],
        *,
        default_weight: float = 1.0,
        runtime: bool = False,
        estimate: Callable[[str], float] = lambda queue: 1.0,
        limits: KeyLimits | None = None,
        slots: int = 1,
        priority_weights: Mapping[int, float] | None = None,
    ) -> None:
        self.queues = frozenset(queues)
        #: None: a keyed queue's priority levels are served strictly in order;
        #: else they share the fetches by weight (``fair_priority="weighted"``,
        #: see :meth:`level_weights`).
        self.priority_weights = None if priority_weights is None else dict(priority_weights)
        self.limits = limits if limits is not None else KeyLimits()
        #: Sends ``(queue, delivery tag)`` releases to the broker (set when a channel is
        #: attached); with ``wake`` true it also ends this worker's idle fetch, in the
        #: same round trip (see ``release``).
        self.send_releases: Callable[[list[tuple[str, str]], bool], None] | None = None
        #: Set by the atomic fetch: whether a fetch of its own follows, on this thread,
        #: that can carry a release (``take_releases``) instead of a round trip of its own.
        self.will_fetch: Callable[[], bool] | None = None
        self._releases: list[tuple[str, str]] = []
        #: Releases carried by the fetch in flight, until its reply arrives.
        self._carried: list[tuple[str, str]] = []
        #: Releases that may not have reached the broker (the connection failed
        #: under them): sent again at the next connection (``resend_releases``).
        self._unsent: list[tuple[str, str]] = []
        self.released = self.release_errors = 0
        #: Delivery tag -> (what happened first, its queue), from dispatch to finish.
        self._tags: dict[Any, tuple[str, str | None]] = {}
        #: Pool slots of this worker: limited tasks fetched and not finished stay
        #: below, plus one while the queue's tasks are short (:data:`LOOKAHEAD_BELOW`).
        self.slots = max(1, slots)
        self._in_flight: dict[str, int] = {}
        self._runtimes: dict[str, Ewma] = {}
        #: Called when a limited queue has room again (wakes an idle fetch).
        self.on_room: Callable[[], None] | None = None
        self.default_weight = default_weight
        self.runtime = runtime
        self.estimate = estimate
        self._lock = threading.Lock()
        self._charges: list[tuple[str, str, str, str, float]] = []
        self._served: dict[str, int] = {}
        self._unkeyed: dict[str, int] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def level_weights(self, steps: Sequence[int]) -> list[float] | None:
        """Each priority level's weight, in level order, or None (strict priority).

        ``steps`` are the transport's priority steps (Kombu's ``priority_steps``:
        a message's priority falls in the level of the largest step not above
        it).  A level takes the weight given for its step, else for the first
        priority given that falls in it, else 1; with no weights given, each
        level weighs half the one before it (8:4:2:1 for four levels).
        """
        given = self.priority_weights
        if given is None:
            return None
        ordered = sorted(steps)
        if not given:
            return [float(2 ** (len(ordered) - 1 - i)) for i in range(len(ordered))]
        weights = []
        for i, step in enumerate(ordered):
            upper = ordered[i + 1] if i + 1 < len(ordered) else None
            inside = [p for p in sorted(given) if p >= step and (upper is None or p < upper)]
            if step in given:
                weights.append(float(given[step]))
            elif inside:
                weights.append(float(given[inside[0]]))
            else:
                weights.append(1.0)
        return weights

    def charge_at_fetch(self, queue: str) -> float:
        """What a message of keyed ``queue`` is charged when fetched."""
        return float(self.estimate(queue)) if self.runtime else 1.0

    @property
    def limited(self) -> bool:
        """Whether the keyed queues have per-key limits (tasks hold leases)."""
        return bool(self.limits)

    def fetch_word(self, queue: str) -> tuple[float, str]:
        """The charge at fetch of keyed ``queue`` and its word for the fetch script."""
        charge = self.charge_at_fetch(queue)
        if self.limited:
            return charge, f"L{charge!r}:{self.limits.lease_ttl!r}"
        return charge, repr(charge)

    # A task holds its key's slot from its fetch until it finishes.  Two events
    # end it: the task's completion (it ran) and its message's ack or reject.
    # With early acks the ack comes when the pool accepts the task, before it
    # runs; a task revoked, expired or rejected before it runs is only acked.
    # So: the slot is freed at completion, or at an ack of a task never
    # dispatched; ``_tags`` remembers which of the two happened first.

    def lease_dispatched(self, queue: str | None, delivery_tag: Any) -> None:
        """A task of ``queue`` (a limited key's) was handed to the pool."""
        if self.limited and delivery_tag:
            with self._lock:
                self._tags[delivery_tag] = (_RUNNING, queue)

    def lease_finished(
        self, queue: str | None, delivery_tag: Any, runtime: float | None = None
    ) -> None:
        """A dispatched task finished after ``runtime`` s (or its pool process died)."""
        if not self.limited or not delivery_tag:
            return
        with self._lock:
            if runtime is not None and queue in self.queues:
                self._runtimes.setdefault(queue, Ewma()).update(max(0.0, runtime))
            state, _ = self._tags.pop(delivery_tag, _UNKNOWN)
            if state == _RUNNING:
                self._tags[delivery_tag] = (_FINISHED, queue)  # its ack is still to come
        self.release(queue, delivery_tag)

    def lease_settled(self, queue: str | None, delivery_tag: Any) -> None:
        """The message was acked or rejected: free the slot of a task that never ran."""
        if not self.limited or not delivery_tag:
            return
        with self._lock:
            state, _ = self._tags.pop(delivery_tag, _UNKNOWN)
            if state == _RUNNING:
                self._tags[delivery_tag] = (_SETTLED, queue)  # it runs: freed when it finishes
                return
        if state is None:
            self.release(queue, delivery_tag)

    def release(self, queue: str | None, delivery_tag: Any) -> None:
        """Release the key slot of ``delivery_tag`` (a message of ``queue``): with the
        next fetch if one follows on this thread, else now."""
        if not self.limited or queue not in self.queues or not delivery_tag:
            return
        assert queue is not None
        with self._lock:
            held = self._in_flight.get(queue, 0)
            self._in_flight[queue] = max(0, held - 1)
        # A finished task's release rides on the next fetch when one follows on
        # this thread (the pool's results come on the worker's loop, as prefork's
        # and solo's do): the pool slot then waits for one round trip, the fetch,
        # not three (the release, the idle fetch's wake-up, the fetch).
        tag = str(delivery_tag)
        will_fetch = self.will_fetch
        if will_fetch is not None and will_fetch():
            with self._lock:
                self._releases.append((queue, tag))
            return
        # Else a worker that was full may fetch from the queue again: its idle fetch
        # must end. The release and that wake-up go in one round trip.
        # "Full" counts from the pool's size, not the capacity: the capacity can
        # change between a fetch and its release, and a wake-up too many costs
        # an empty fetch, one too few a poll interval.
        self.send_now([(queue, tag)], wake=held >= self.slots)

    def take_releases(self) -> list[tuple[str, str]]:
        """The releases to carry on the fetch being sent, ``(queue, delivery tag)``.

        Counted as released; kept until :meth:`confirm_releases` (the fetch's
        reply), so that a connection lost under the fetch sends them again.
        """
        with self._lock:
            releases, self._releases = self._releases, []
            self.released += len(releases)
            self._carried.extend(releases)
        return releases

    def confirm_releases(self) -> None:
        """The fetch that carried releases has its reply: the broker ran them."""
        if self._carried:
            with self._lock:
                self._carried.clear()

    def resend_releases(self) -> int:
        """Send the releases the broker may not have had (a new connection): how many.

        A release the broker had already run finds no lease and frees nothing,
        so sending one twice is harmless.  Sent again rather than left to the
        leases' expiry (``lease_ttl``, by default the visibility timeout, an
        hour): until then a key's slot would stay held after every broker
        restart or failover that broke a release.
        """
        with self._lock:
            releases, self._unsent = self._unsent, []
        if releases:
            self.send_now(releases)
        return len(releases)

    def flush_releases(self) -> None:
        """Send the releases waiting for a fetch now (no fetch follows soon)."""
        with self._lock:
            releases, self._releases = self._releases, []
        if releases:
            self.send_now(releases)

    def send_now(self, releases: list[tuple[str, str]], wake: bool = False) -> None:
        """Free these key slots in a round trip of their own; ``wake`` ends an idle fetch."""
        send = self.send_releases
        if send is None:
            # No sender yet (before the first connection's settings are written):
            # kept for it, which sends them with resend_releases, not dropped to
            # wait for the leases' expiry.
            if wake and self.on_room is not None:
                self.on_room()
            self._keep_unsent(releases)
            return
        try:
            send(releases, wake)
        except Exception as exc:  # sent again at the next connection: never fatal
            if wake and self.on_room is not None:
                self.on_room()  # the fetch must not wait for its timeout as well
            with self._lock:
                self.release_errors += len(releases)
            self._keep_unsent(releases)
            logger.warning(
                "celery-fair: could not release the key slot of message(s) %s (%r); "
                "sent again at the next connection",
                ", ".join(tag for _, tag in releases), exc,
            )  # fmt: skip
            return
        with self._lock:
            self.released += len(releases)

    def _keep_unsent(self, releases: list[tuple[str, str]]) -> None:
        with self._lock:
            self._unsent.extend(releases)
            del self._unsent[:-MAX_UNSENT_RELEASES]

    def adopt(self, queues: Iterable[str]) -> None:
        """Serve these queues as keyed too (a keyed backlog ``fair_keys`` does not name)."""
        self.queues = self.queues | frozenset(queues)

    def has_room(self, queue: str) -> bool:
        """Whether this worker may fetch from keyed ``queue`` now.

        With per-key limits a fetched task holds its key's slot until it
        finishes, so a worker fetches for its free pool slots (and one task
        ahead while tasks are short, see :meth:`capacity`): tasks that would
        wait in its buffer would keep their keys' slots from workers with
        free pool slots.
        """
        return not self.limited or self._in_flight.get(queue, 0) < self.capacity(queue)

    def capacity(self, queue: str) -> int:
        """Tasks of limited ``queue`` this worker holds at most: pool slots, +1 if short."""
        estimate = self._runtimes.get(queue)
        mean = None if estimate is None else estimate.value
        return self.slots + 1 if mean is not None and mean < LOOKAHEAD_BELOW else self.slots

    def held(self, queue: str) -> int:
        """Tasks of limited ``queue`` this worker counts as holding a key slot."""
        with self._lock:
            return self._in_flight.get(queue, 0)

    def recount(self, queue: str, held: int) -> int:
        """This worker holds ``held`` tasks of ``queue``, fewer than it counts: a release
        was lost.  Count those; the fetch may take more of ``queue`` at once.

        The leases on the broker are not touched: the one whose release was lost
        expires after ``lease_ttl``.  Returns how many the count had too many.
        """
        with self._lock:
            extra = self._in_flight.get(queue, 0) - max(0, held)
            if extra <= 0:
                return 0
            self._in_flight[queue] = max(0, held)
        if self.on_room is not None:
            self.on_room()
        return extra

    def reset(self, running_unreported: bool = False) -> int:
        """A new channel: the previous one's messages went back to the broker.

        Releases carried by a fetch whose reply never came, or still waiting
        for a fetch, go to :meth:`resend_releases`.  ``running_unreported``:
        the pool will not report the finish of the tasks running now (see
        :func:`celery_fair.compat.pool_forgets_running_tasks`), so their slots
        go with those releases, rather than stay held until their leases
        expire.  Returns how many such running tasks there were.
        """
        running: list[tuple[str, str]] = []
        with self._lock:
            if running_unreported:
                running = [
                    (queue, str(tag))
                    for tag, (state, queue) in self._tags.items()
                    if state != _FINISHED and queue is not None and queue in self.queues
                ]
            self._in_flight.clear()
            self._tags.clear()
            self._unsent.extend(self._carried + self._releases + running)
            self._carried, self._releases = [], []
            del self._unsent[:-MAX_UNSENT_RELEASES]
        return len(running)

    def served(self, queue: str, key: str) -> None:
        """The fetch served ``key`` of ``queue``."""
        with self._lock:
            if self.limited:
                self._in_flight[queue] = self._in_flight.get(queue, 0) + 1
            self._served[queue] = self._served.get(queue, 0) + 1
            if key == UNKEYED:
                self._unkeyed[queue] = self._unkeyed.get(queue, 0) + 1
            counts = self._counts
            pair = (queue, key)
            counts[pair] = counts.get(pair, 0) + 1
            if len(counts) > COUNTED_KEYS:
                _halve(counts)

    def finished(self, queue: str, served: Served, runtime: float) -> None:
        """A task fetched as ``served`` (its served header) ran ``runtime`` s."""
        charged = served.charge
        if not self.runtime or queue not in self.queues or charged is None:
            return
        delta = max(0.0, runtime) - charged
        with self._lock:
            if len(self._charges) >= MAX_PENDING_CHARGES:
                del self._charges[0]
            self._charges.append((queue, served.level, served.key, served.user, delta))

    def take_charges(self) -> list[tuple[str, str, str, str, float]]:
        """The corrections not yet sent, ``(queue, level suffix, key, user, delta)``
        (and forget them); ``user`` is ``""`` for a one-level key."""
        with self._lock:
            charges, self._charges = self._charges, []
        return charges

    def statistics(self, top: int = 10) -> KeyStatistics:
        with self._lock:
            ranked = sorted(self._counts.items(), key=lambda item: -item[1])[:top]
            return KeyStatistics(
                queues=tuple(sorted(self.queues)),
                default_weight=self.default_weight,
                cost="runtime" if self.runtime else "count",
                served=dict(self._served),
                unkeyed=dict(self._unkeyed),
                top=tuple((q, k, n) for (q, k), n in ranked),
                pending_charges=len(self._charges),
                concurrency=dict(self.limits.concurrency),
                rates=dict(self.limits.rates),
                lease_ttl=self.limits.lease_ttl,
                released=self.released,
                release_errors=self.release_errors,
                unsent_releases=len(self._unsent),
            )


def _halve(counts: dict[tuple[str, str], int]) -> None:
    for pair in list(counts):
        counts[pair] //= 2
        if not counts[pair]:
            del counts[pair]
