"""Automatic isolation of a noisy key: who takes too large a share of recent publishes.

A pure module (no Celery, Kombu or broker I/O; the clock is injected) used by
``ConsistentHashRouter(..., isolate=...)``. Its only side effect is one log
line per transition.

:class:`NoisyKeyDetector` counts publishes per key with exponentially decayed
weights (half-life ``half_life``), so "recent" needs no buckets and no timer,
and keeps them in a Space-Saving summary (Metwally, Agrawal & El Abbadi,
"Efficient computation of frequent and top-k elements in data streams", ICDT
2005) of ``capacity`` counters: millions of distinct keys cost O(capacity)
memory, and every key above ``1 / capacity`` of the publishes is tracked with
an error of at most ``1 / capacity`` of them.

Decay uses *forward decay* (Cormode, Shkapenyuk, Srivastava & Xu, "Forward
decay: a practical time decay model for streaming systems", ICDE 2009): a
publish at time ``t`` adds ``2 ** ((t - L) / half_life)`` for a landmark
``L``, and every weight is read relative to ``2 ** ((now - L) / half_life)``.
Decay multiplies all counters by the same factor, so Space-Saving's order and
error bound hold unchanged and an update touches one counter only.

A key *enters* isolation when its guaranteed share (count minus the summary's
error, over the decayed total) exceeds ``enter_share`` and its guaranteed
count reaches ``min_messages``. It *leaves* once its estimated share has
stayed under ``exit_share``, or its count under ``min_messages``, for
``hold`` seconds: the gap between the two shares and the hold are the
hysteresis that keeps a key near the threshold from flapping between queues.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = (
    "DEFAULT_ISOLATION_QUEUE",
    "NOISY_MESSAGES",
    "NOISY_SHARE",
    "IsolationPolicy",
    "IsolationStatistics",
    "NoisyKeyDetector",
)

logger = logging.getLogger(__name__)

#: The queue name used in examples and by ``IsolationPolicy()`` without arguments.
DEFAULT_ISOLATION_QUEUE = "fair.isolated"

#: A noisy key, as SQS fair queues define a noisy tenant: more than this share
#: of the recent work ...
NOISY_SHARE = 0.10
#: ... with at least this many messages of its own (SQS: 30 in flight), so a
#: quiet system never has one.  The router's isolation and the report's
#: in-flight and processing-time rules (:mod:`celery_fair.analytics.noisy`)
#: share these defaults.
NOISY_MESSAGES = 30

# Rescale the forward-decay weights once the landmark is this many half-lives
# old: 2 ** 64 keeps every float far from overflow and loses no precision that
# matters (relative error stays 2 ** -52).
_RENORMALISE_AFTER = 64.0
# The lazy min-heap holds stale entries; rebuild it when it is this many times
# the number of counters, so its size (and memory) stays O(capacity).
_HEAP_SLACK = 4


@dataclass(frozen=True)
class IsolationPolicy:
    """Where noisy keys go and when a key counts as noisy (all checked when built).

    ``queue``: the isolation queue. ``enter_share``: a key is isolated when it
    takes more than this fraction of recent publishes (SQS fair queues flag a
    tenant above 10% of in-flight messages) ... ``min_messages``: ... and has
    at least this many recent publishes (SQS: 30), so a quiet system never
    isolates anyone. ``exit_share``: the key is released when its share has
    stayed below this fraction (or its count below ``min_messages``) for
    ``hold`` seconds. ``half_life``: seconds after which a publish counts half;
    "recent publishes" are about ``half_life / ln 2`` seconds' worth.
    ``capacity``: counters of the heavy-hitters summary (memory and accuracy:
    shares are known to within ``1 / capacity``).
    """

    queue: str = DEFAULT_ISOLATION_QUEUE
    enter_share: float = NOISY_SHARE
    exit_share: float = NOISY_SHARE / 2
    min_messages: float = NOISY_MESSAGES
    half_life: float = 10.0
    hold: float = 10.0
    capacity: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.queue, str) or not self.queue:
            raise ValueError(f"queue={self.queue!r}: must be a non-empty string")
        enter = _number("enter_share", self.enter_share)
        exit_ = _number("exit_share", self.exit_share)
        if not 0 < enter < 1:
            raise ValueError(f"enter_share={self.enter_share!r}: must be in (0, 1)")
        if not 0 < exit_ <= enter:
            raise ValueError(
                f"exit_share={self.exit_share!r}: must be in (0, enter_share={self.enter_share!r}]"
            )
        if _number("min_messages", self.min_messages) < 1:
            raise ValueError(f"min_messages={self.min_messages!r}: must be >= 1")
        if _number("half_life", self.half_life) <= 0:
            raise ValueError(f"half_life={self.half_life!r}: must be > 0 seconds")
        if _number("hold", self.hold) < 0:
            raise ValueError(f"hold={self.hold!r}: must be >= 0 seconds")
        capacity = self.capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ValueError(f"capacity={capacity!r}: must be an integer")
        # The summary overestimates a count by at most 1/capacity of the total:
        # keep that under half the exit share, or releases would come late.
        least = math.ceil(2 / exit_)
        if capacity < least:
            raise ValueError(
                f"capacity={capacity!r}: must be >= 2 / exit_share = {least} "
                f"(the counting error is up to 1 / capacity of the publishes)"
            )


@dataclass(frozen=True)
class IsolationStatistics:
    """A snapshot of the detector.

    ``isolated``: isolated key -> its current estimated share of recent
    publishes. ``isolations`` / ``releases``: transitions since the detector
    was built (``transitions`` is their sum). ``observed``: publishes seen.
    ``recent``: the decayed number of recent publishes (the denominator of
    the shares). ``tracked``: keys held by the summary (at most ``capacity``).
    """

    queue: str
    isolated: Mapping[str, float]
    isolations: int
    releases: int
    observed: int
    recent: float
    tracked: int
    capacity: int

    @property
    def transitions(self) -> int:
        """Isolations plus releases."""
        return self.isolations + self.releases


@dataclass
class _Isolated:
    since: float
    # When the key last fell under the exit condition (None: it is above it).
    calm_since: float | None = None


@dataclass
class _State:
    counts: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    heap: list[tuple[float, str]] = field(default_factory=list)
    total: float = 0.0
    landmark: float = 0.0


class NoisyKeyDetector:
    """Decides, publish by publish, whether a key is isolated (thread-safe).

    ``observe(key)`` counts one publish of ``key`` and returns whether the
    key is isolated now. ``clock`` returns seconds (monotonic); tests inject
    a fake one.
    """

    def __init__(
        self,
        policy: IsolationPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = IsolationPolicy() if policy is None else policy
        self._clock = clock
        self._lock = threading.Lock()
        self._state = _State(landmark=clock())
        self._isolated: dict[str, _Isolated] = {}
        self._isolations = 0
        self._releases = 0
        self._observed = 0

    def __repr__(self) -> str:
        return f"NoisyKeyDetector({self.policy!r})"

    def observe(self, key: str) -> bool:
        """Count one publish of ``key``; return whether it goes to the isolation queue."""
        now = self._clock()
        with self._lock:
            self._observed += 1
            self._add(key, now)
            scale = self._scale(now)
            if key not in self._isolated:
                self._maybe_isolate(key, now, scale)
            # Shares move only when something is published, so re-checking the
            # (few) isolated keys on each publish is enough to see them calm down.
            if self._isolated:
                self._check_releases(now, scale)
            return key in self._isolated

    def is_isolated(self, key: str) -> bool:
        """Whether ``key`` is isolated now (counts nothing)."""
        now = self._clock()
        with self._lock:
            if self._isolated:
                self._check_releases(now, self._scale(now))
            return key in self._isolated

    def share(self, key: str) -> float:
        """``key``'s estimated share of recent publishes (0 if it is not tracked)."""
        with self._lock:
            return self._share(self._state.counts.get(key, 0.0))

    def statistics(self) -> IsolationStatistics:
        """Return a frozen snapshot (releases due by now are applied first)."""
        now = self._clock()
        with self._lock:
            scale = self._scale(now)
            if self._isolated:
                self._check_releases(now, scale)
            state = self._state
            return IsolationStatistics(
                queue=self.policy.queue,
                isolated={k: self._share(state.counts.get(k, 0.0)) for k in self._isolated},
                isolations=self._isolations,
                releases=self._releases,
                observed=self._observed,
                recent=state.total * scale,
                tracked=len(state.counts),
                capacity=self.policy.capacity,
            )

    # -- the summary (callers hold the lock) -----------------------------------------------

    def _scale(self, now: float) -> float:
        """Factor turning stored (landmark) weights into decayed counts at ``now``."""
        return float(2.0 ** (-(now - self._state.landmark) / self.policy.half_life))

    def _add(self, key: str, now: float) -> None:
        state = self._state
        age = (now - state.landmark) / self.policy.half_life
        if age > _RENORMALISE_AFTER:
            self._renormalise(now)
            age = 0.0
        weight = float(2.0**age)
        state.total += weight
        counts = state.counts
        count = counts.get(key)
        if count is not None:
            count += weight
        elif len(counts) < self.policy.capacity:
            count = weight
            state.errors[key] = 0.0
        else:
            # Space-Saving: the least counted key gives its counter to the newcomer,
            # whose count may be overestimated by at most that least count.
            floor, evicted = self._pop_min()
            del counts[evicted]
            del state.errors[evicted]
            count = floor + weight
            state.errors[key] = floor
        counts[key] = count
        heapq.heappush(state.heap, (count, key))
        if len(state.heap) > _HEAP_SLACK * self.policy.capacity + 16:
            self._rebuild_heap()

    def _pop_min(self) -> tuple[float, str]:
        # The heap is lazy: an entry is current only if it matches the key's count.
        state = self._state
        while True:
            count, key = heapq.heappop(state.heap)
            if state.counts.get(key) == count:
                return count, key

    def _rebuild_heap(self) -> None:
        state = self._state
        state.heap = [(c, k) for k, c in state.counts.items()]
        heapq.heapify(state.heap)

    def _renormalise(self, now: float) -> None:
        state = self._state
        factor = self._scale(now)
        state.counts = {k: c * factor for k, c in state.counts.items()}
        state.errors = {k: e * factor for k, e in state.errors.items()}
        state.total *= factor
        state.landmark = now
        self._rebuild_heap()

    def _share(self, count: float) -> float:
        total = self._state.total
        return count / total if total > 0 else 0.0

    # -- transitions -----------------------------------------------------------------------

    def _maybe_isolate(self, key: str, now: float, scale: float) -> None:
        state, policy = self._state, self.policy
        # The guaranteed count (Space-Saving never underestimates, and overestimates
        # by at most the recorded error): a newly tracked key cannot enter on error.
        sure = state.counts[key] - state.errors[key]
        if sure * scale < policy.min_messages or sure <= policy.enter_share * state.total:
            return
        self._isolated[key] = _Isolated(since=now)
        self._isolations += 1
        recent = state.total * scale
        logger.warning(
            "celery-fair: key %r isolated to queue %r (share %.0f%% of the last %.0f "
            "publishes, above %.0f%%)",
            key, policy.queue, 100 * sure / state.total, recent, 100 * policy.enter_share,
        )  # fmt: skip

    def _check_releases(self, now: float, scale: float) -> None:
        state, policy = self._state, self.policy
        released = []
        for key, entry in self._isolated.items():
            count = state.counts.get(key, 0.0)
            calm = count <= policy.exit_share * state.total or count * scale < policy.min_messages
            if not calm:
                entry.calm_since = None
                continue
            if entry.calm_since is None:
                entry.calm_since = now
            if now - entry.calm_since >= policy.hold:
                released.append((key, entry, count))
        for key, entry, count in released:
            del self._isolated[key]
            self._releases += 1
            logger.info(
                "celery-fair: key %r released from queue %r after %.0f s (share %.1f%% of "
                "the last %.0f publishes; under %.0f%% or under %g publishes for %g s)",
                key, policy.queue, now - entry.since, 100 * self._share(count),
                state.total * scale, 100 * policy.exit_share, policy.min_messages, policy.hold,
            )  # fmt: skip


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")
    return float(value)
