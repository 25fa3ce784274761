"""The worker's side of keyed queues: fetch charges, run-time corrections, counts.

One :class:`KeyedServing` per worker, shared by the atomic fetch (which asks
what to charge and reports each key it served), the task tracker (which
reports run times) and, with per-key limits, the QoS and the task observers
(which free the key slots).  It is made of one part per job, each built
with what it needs:

* :class:`FetchTerms`: what the fetch script is told of each keyed queue;
* :class:`~celery_fair.keys.leases.Leases`: the key slots held here;
* :class:`~celery_fair.keys.releases.ReleaseOutbox`: their releases, until
  the broker has them;
* :class:`~celery_fair.keys.counters.KeyCounters`: the served keys counted,
  and the run-time corrections the next fetch carries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..wire.served import Served
from .counters import KeyCounters
from .leases import Leases
from .limits import KeyLimits
from .releases import ReleaseCarrier, ReleaseOutbox

__all__ = ("FetchTerms", "KeyStatistics", "KeyedServing", "level_weights")


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


def level_weights(
    given: Mapping[int, float], steps: Sequence[int], *, highest_first: bool = False
) -> list[float]:
    """Each priority level's weight, in the order of ``steps`` sorted (``fair_priority_weights``).

    A message's priority falls in the level of the largest step not above it.
    A level takes the weight ``given`` for its step, else for the first
    priority given that falls in it, else 1; with none given, each level
    weighs half the one more urgent than it (8:4:2:1 for four levels): the
    lowest step is the most urgent on Redis (Kombu's order), the highest with
    ``highest_first`` (RabbitMQ's).
    """
    ordered = sorted(steps)
    n = len(ordered)
    if not given:
        return [float(2 ** (i if highest_first else n - 1 - i)) for i in range(n)]
    weights = []
    for i, step in enumerate(ordered):
        upper = ordered[i + 1] if i + 1 < n else None
        inside = [p for p in sorted(given) if p >= step and (upper is None or p < upper)]
        if step in given:
            weights.append(float(given[step]))
        elif inside:
            weights.append(float(given[inside[0]]))
        else:
            weights.append(1.0)
    return weights


class FetchTerms:
    """What the fetch script is told of the keyed queues: each one's word (the
    charge at fetch, and the lease with per-key limits), the default key weight
    and the priority levels' weights.

    ``estimate(queue)`` is the charge at fetch in run-time mode (the
    worker's moving average of the queue's run time); in count mode every
    message is charged 1 and nothing is corrected.
    """

    def __init__(
        self,
        *,
        limits: KeyLimits,
        default_weight: float = 1.0,
        runtime: bool = False,
        estimate: Callable[[str], float] = lambda queue: 1.0,
        priority_weights: Mapping[int, float] | None = None,
    ) -> None:
        self.limits = limits
        self.default_weight = default_weight
        self.runtime = runtime
        self.estimate = estimate
        #: None: a keyed queue's priority levels are served strictly in order;
        #: else they share the fetches by weight (``fair_priority="weighted"``,
        #: see :meth:`level_weights`).
        self.priority_weights = None if priority_weights is None else dict(priority_weights)

    def level_weights(self, steps: Sequence[int]) -> list[float] | None:
        """Each priority level's weight, in level order, or None (strict priority).

        ``steps`` are the transport's priority steps (Kombu's ``priority_steps``:
        a message's priority falls in the level of the largest step not above
        it).  A level takes the weight given for its step, else for the first
        priority given that falls in it, else 1; with no weights given, each
        level weighs half the one before it (8:4:2:1 for four levels).
        """
        if self.priority_weights is None:
            return None
        return level_weights(self.priority_weights, steps)

    def charge_at_fetch(self, queue: str) -> float:
        """What a message of keyed ``queue`` is charged when fetched."""
        return float(self.estimate(queue)) if self.runtime else 1.0

    def fetch_word(self, queue: str) -> tuple[float, str]:
        """The charge at fetch of keyed ``queue`` and its word for the fetch script."""
        charge = self.charge_at_fetch(queue)
        if self.limits:
            return charge, f"L{charge!r}:{self.limits.lease_ttl!r}"
        return charge, repr(charge)


class KeyedServing:
    """Keyed queues on one worker: its parts, and what takes more than one of them."""

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
        limits = limits if limits is not None else KeyLimits()
        self.terms = FetchTerms(
            limits=limits,
            default_weight=default_weight,
            runtime=runtime,
            estimate=estimate,
            priority_weights=priority_weights,
        )
        self.releases = ReleaseOutbox()
        self.leases = Leases(queues, self.releases, limits=limits, slots=slots)
        self.counters = KeyCounters(runtime=runtime)

    @property
    def queues(self) -> frozenset[str]:
        """The keyed queues: those of ``fair_keys``, and keyed backlogs adopted."""
        return self.leases.queues

    @property
    def limited(self) -> bool:
        """Whether the keyed queues have per-key limits (tasks hold leases)."""
        return self.leases.limited

    def adopt(self, queues: Iterable[str]) -> None:
        """Serve these queues as keyed too (a keyed backlog ``fair_keys`` does not name)."""
        self.leases.adopt(queues)

    def fetched_by(self, fetch: ReleaseCarrier | None) -> None:
        """``fetch`` (a channel's atomic fetch) serves the keyed queues from now on:
        releases ride on it, and a slot freed ends its idle wait."""
        self.releases.fetched_by(fetch)

    def served(self, queue: str, key: str) -> None:
        """The fetch served ``key`` of ``queue``."""
        self.leases.fetched(queue)
        self.counters.served(queue, key)

    def finished(self, queue: str, served: Served, runtime: float) -> None:
        """A task fetched as ``served`` (its served header) ran ``runtime`` s."""
        if queue in self.queues:
            self.counters.finished(queue, served, runtime)

    def reset(self, running_unreported: bool = False) -> int:
        """A new channel: the previous one's messages went back to the broker.

        Releases carried by a fetch whose reply never came, or still waiting
        for a fetch, are sent again when the next sender is attached
        (:meth:`~celery_fair.keys.releases.ReleaseOutbox.attach`).  ``running_unreported``: the pool
        will not report the finish of the tasks running now (see
        :func:`celery_fair.compat.pool_forgets_running_tasks`), so their
        slots go with those releases, rather than stay held until their
        leases expire.  Returns how many such running tasks there were.
        """
        running = self.leases.reset(running_unreported)
        self.releases.lost(running)
        return len(running)

    def flush_releases(self) -> None:
        """Send the releases waiting for a fetch now (no fetch follows soon)."""
        self.releases.flush()

    def statistics(self, top: int = 10) -> KeyStatistics:
        counts = self.counters.reading(top)
        terms, releases = self.terms, self.releases
        limits = terms.limits
        return KeyStatistics(
            queues=tuple(sorted(self.queues)),
            default_weight=terms.default_weight,
            cost="runtime" if terms.runtime else "count",
            served=counts.served,
            unkeyed=counts.unkeyed,
            top=counts.top,
            pending_charges=counts.pending_charges,
            concurrency=dict(limits.concurrency),
            rates=dict(limits.rates),
            lease_ttl=limits.lease_ttl,
            released=releases.released,
            release_errors=releases.errors,
            unsent_releases=releases.unsent,
        )
