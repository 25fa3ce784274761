"""``ConsistentHashRouter``: a Celery ``task_routes`` entry sending each task key to one queue."""

from __future__ import annotations

import fnmatch
import functools
import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_fair.routing.isolation import IsolationPolicy, IsolationStatistics, NoisyKeyDetector
from celery_fair.routing.keys import KeySource, KeySpec, key_of, parse_key_spec
from celery_fair.routing.ring import HashRing, RingKey, canonical_key

from ..wire import KEY_HEADER

__all__ = ("ConsistentHashRouter", "MissingRouteKeyError", "RouterStatistics")

DEFAULT_HEADER = KEY_HEADER


class MissingRouteKeyError(LookupError):
    """A task routed by key was sent without its key (``on_missing="error"``)."""


@dataclass(frozen=True)
class RouterStatistics:
    """Counts since the router was built: tasks per queue and how missing keys were handled.

    ``routed`` includes the isolation queue when ``isolate=`` is set, and
    ``isolation`` is then the noisy-key detector's snapshot (else ``None``).
    """

    routed: Mapping[str, int]
    missing_errors: int
    missing_spread: int
    missing_fallback: int
    cache_hits: int
    cache_misses: int
    isolation: IsolationStatistics | None = None


class ConsistentHashRouter:
    """Route tasks to queues by consistent hashing of a task key (tenant, account, shard).

    Use it in ``task_routes``::

        app.conf.task_routes = (
            ConsistentHashRouter({"t0": 10, "t1": 10, "t2": 20}, key="tenant_id"),
        )

    ``queues`` maps queue name to weight, or lists names for equal weights. A
    key always reaches the same queue, in every process, whatever the order of
    ``queues``; a queue receives keys in proportion to its weight; changing
    the queues moves only the keys that must move (see ``HashRing``).

    ``key`` says where the key is: a keyword argument name (``"tenant_id"``),
    a positional index (``0``), ``"header:<name>"`` (from
    ``apply_async(headers=...)``), ``"property:message_id"`` or
    ``"property:correlation_id"`` (from ``apply_async(message_id=...)``), or a
    callable ``f(name, args, kwargs, options)``. Keys are str, int, UUID or
    UTF-8 bytes; ``None`` or ``""`` means the key is missing.

    ``tasks`` limits the router to task names matching these exact names or
    glob patterns (or compiled regexes), as Celery's routes accept; for other
    tasks it returns ``None`` so the next route applies.

    ``on_missing`` decides what a task without a key does: ``"error"``
    (default) raises ``MissingRouteKeyError`` from ``apply_async``;
    ``"spread"`` sends it to a random queue chosen by weight; any other string
    is a queue name to send it to. Never a silent pile-up on one ring queue.

    ``header`` (default ``"fair_key"``) is the message header the key's text is
    stamped into, so workers and telemetry see it (``task.request.fair_key``);
    ``None`` turns stamping off.

    ``exchange`` switches to broker-side routing: tasks are published to that
    ``x-consistent-hash`` exchange (see ``declare_consistent_hash_exchange``)
    with the key as routing key and header, and RabbitMQ picks the queue. The
    missing-key policy still applies on the producer side.

    ``algorithm`` picks the ring's mapping (``"auto"``, ``"rendezvous"`` or
    ``"table"``, see ``HashRing``): the default is rendezvous hashing;
    ``"auto"`` or ``"table"`` opt in to the O(1) probe table
    (which moves keys once); ``table_weight`` pins a table's
    layout. Both apply when ``queues`` is a mapping or list; a ``HashRing``
    carries its own.

    ``cache_size`` bounds a memo of key -> queue (0 disables it): tenants
    repeat, and a memo hit is cheaper than any lookup.

    ``isolate`` (opt-in) turns on automatic isolation of noisy keys: every
    routed key is counted, and a key that takes more than its policy's share
    of recent publishes is sent to the isolation queue instead of its ring
    queue (directly, also in ``exchange`` mode) until it calms down. A string
    is the isolation queue's name with the default thresholds; an
    ``IsolationPolicy`` sets them; a ``NoisyKeyDetector`` is used as given
    (for an injected clock). Workers must consume that queue too, at a low
    weight: see ``worker_queues()``.
    """

    def __init__(
        self,
        queues: Mapping[str, float] | Iterable[str] | HashRing,
        *,
        key: KeySpec | KeySource,
        tasks: str | re.Pattern[str] | Iterable[str | re.Pattern[str]] | None = None,
        on_missing: str = "error",
        header: str | None = DEFAULT_HEADER,
        exchange: str | None = None,
        cache_size: int = 4096,
        algorithm: str | None = None,
        table_weight: float | None = None,
        isolate: IsolationPolicy | NoisyKeyDetector | str | None = None,
    ) -> None:
        if isinstance(queues, HashRing):
            if algorithm is not None or table_weight is not None:
                raise ValueError(
                    "algorithm= and table_weight= apply to a mapping or list of queues; "
                    "a HashRing carries its own (HashRing(..., algorithm=...))"
                )
            self.ring = queues
        else:
            chosen = "rendezvous" if algorithm is None else algorithm
            self.ring = _build_ring(queues, algorithm=chosen, table_weight=table_weight)
        self.key_source = parse_key_spec(key)
        self._task_patterns = _compile_tasks(tasks)
        self.on_missing = _check_on_missing(on_missing)
        if header is not None and (not isinstance(header, str) or not header):
            raise ValueError(f"header={header!r}: must be a non-empty string or None")
        self.header = header
        if exchange is not None and (not isinstance(exchange, str) or not exchange):
            raise ValueError(f"exchange={exchange!r}: must be a non-empty string or None")
        self.exchange = exchange
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size={cache_size!r}: must be an integer >= 0")
        self._lookup = (
            functools.lru_cache(maxsize=cache_size)(self.ring.lookup)
            if cache_size
            else self.ring.lookup
        )
        self._matches: dict[str, bool] = {}
        self._lock = threading.Lock()
        self.detector = _build_detector(isolate, self.ring)
        self._routed: dict[str, int] = dict.fromkeys(self.worker_queues(), 0)
        self._missing = {"error": 0, "spread": 0, "fallback": 0}

    def __repr__(self) -> str:
        return (
            f"ConsistentHashRouter({self.ring.weights!r}, key={self.key_source.describe()!r}, "
            f"on_missing={self.on_missing!r}, algorithm={self.ring.algorithm!r}"
            + ("" if self.detector is None else f", isolate={self.detector.policy!r}")
            + ")"
        )

    def queue_for(self, key: RingKey) -> str:
        """Return the ring queue of ``key`` (where it goes whenever it is not isolated)."""
        return self._lookup(canonical_key(key))

    @property
    def isolation_queue(self) -> str | None:
        """The queue noisy keys are isolated to, or ``None`` without ``isolate=``."""
        return None if self.detector is None else self.detector.policy.queue

    def worker_queues(self) -> list[str]:
        """The queues workers must consume: the ring's (sorted), then the isolation queue.

        Give the isolation queue a low ``fair_weights`` entry (e.g. 0.25 with
        ring weights of 1): it holds only the noisiest keys' tasks.
        """
        queues = sorted(self.ring.queues)
        if self.detector is not None:
            queues.append(self.detector.policy.queue)
        return queues

    def applies_to(self, name: str) -> bool:
        """Whether this router routes task ``name`` (the ``tasks=`` filter)."""
        if self._task_patterns is None:
            return True
        matched = self._matches.get(name)
        if matched is None:
            matched = any(p.match(name) for p in self._task_patterns)
            if len(self._matches) < 65536:
                self._matches[name] = matched
        return matched

    def __call__(
        self,
        name: str,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        task: Any = None,
        **kw: Any,
    ) -> dict[str, Any] | None:
        """Celery's router protocol: return the route for one task, or ``None``."""
        if not self.applies_to(name):
            return None
        raw = key_of(self.key_source, name, args or (), kwargs or {}, options, task)
        if raw is None or raw == "" or raw == b"":
            return self._route_missing(name)
        try:
            text = canonical_key(raw)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"task {name!r}: {self.key_source.describe()}: {exc}") from None
        route: dict[str, Any]
        if self.detector is not None and self.detector.observe(text):
            # Straight to the isolation queue, in exchange mode too: the hash
            # exchange would put the key back on its ring queue.
            queue = self.detector.policy.queue
            with self._lock:
                self._routed[queue] += 1
            route = {"queue": queue}
        elif self.exchange is None:
            queue = self._lookup(text)
            with self._lock:
                self._routed[queue] += 1
            route = {"queue": queue}
        else:
            route = {
                "exchange": self.exchange,
                "exchange_type": "x-consistent-hash",
                "routing_key": text,
            }
        if self.header is not None:
            self._stamp(route, options, text)
        return route

    def _stamp(self, route: dict[str, Any], options: dict[str, Any], text: str) -> None:
        # Celery merges a route under the caller's options (celery.app.routes.Router.route,
        # lpmerge): a caller's own ``headers=`` would replace ours wholesale. So the
        # stamp goes into both; the caller's dict is copied, never mutated.
        route["headers"] = {self.header: text}
        caller_headers = options.get("headers")
        if isinstance(caller_headers, Mapping):
            options["headers"] = {**caller_headers, self.header: text}

    def _route_missing(self, name: str) -> dict[str, Any]:
        if self.on_missing == "error":
            with self._lock:
                self._missing["error"] += 1
            raise MissingRouteKeyError(
                f"task {name!r} has no routing key: {self.key_source.describe()} is missing "
                f"or empty (ConsistentHashRouter on_missing='error'; use on_missing='spread' "
                f"or a queue name to route such tasks)"
            )
        if self.on_missing == "spread":
            # A fresh random point, so unkeyed tasks spread by weight instead of piling up.
            queue = self.ring.lookup_hash(secrets.randbits(64))
            with self._lock:
                self._missing["spread"] += 1
                self._routed[queue] += 1
            return {"queue": queue}
        with self._lock:
            self._missing["fallback"] += 1
        return {"queue": self.on_missing}

    def statistics(self) -> RouterStatistics:
        """Return the router's counters as a frozen record."""
        info = getattr(self._lookup, "cache_info", None)
        hits, misses = (info().hits, info().misses) if info else (0, 0)
        isolation = None if self.detector is None else self.detector.statistics()
        with self._lock:
            return RouterStatistics(
                routed=dict(self._routed),
                missing_errors=self._missing["error"],
                missing_spread=self._missing["spread"],
                missing_fallback=self._missing["fallback"],
                cache_hits=hits,
                cache_misses=misses,
                isolation=isolation,
            )


def _build_ring(
    queues: Mapping[str, float] | Iterable[str], *, algorithm: str, table_weight: float | None
) -> HashRing:
    try:
        return HashRing(queues, algorithm=algorithm, table_weight=table_weight)
    except (TypeError, ValueError) as exc:
        # The option errors name their parameter already; queue errors get the queues.
        message = str(exc)
        if message.startswith(("algorithm=", "table_weight=")):
            raise
        raise type(exc)(f"queues={queues!r}: {message}") from None


def _build_detector(
    isolate: IsolationPolicy | NoisyKeyDetector | str | None, ring: HashRing
) -> NoisyKeyDetector | None:
    if isolate is None:
        return None
    if isinstance(isolate, NoisyKeyDetector):
        detector = isolate
    elif isinstance(isolate, IsolationPolicy):
        detector = NoisyKeyDetector(isolate)
    elif isinstance(isolate, str) and isolate:
        detector = NoisyKeyDetector(IsolationPolicy(queue=isolate))
    else:
        raise ValueError(
            f"isolate={isolate!r}: must be a queue name, an IsolationPolicy, "
            f"a NoisyKeyDetector or None"
        )
    if detector.policy.queue in ring.queues:
        # Isolated keys would share a ring queue with the keys hashed to it.
        raise ValueError(
            f"isolate={isolate!r}: the isolation queue {detector.policy.queue!r} "
            f"must not be one of the ring's queues"
        )
    return detector


def _check_on_missing(on_missing: object) -> str:
    if not isinstance(on_missing, str) or not on_missing:
        raise ValueError(f"on_missing={on_missing!r}: must be 'error', 'spread' or a queue name")
    return on_missing


def _compile_tasks(
    tasks: str | re.Pattern[str] | Iterable[str | re.Pattern[str]] | None,
) -> tuple[re.Pattern[str], ...] | None:
    if tasks is None:
        return None
    items = [tasks] if isinstance(tasks, (str, re.Pattern)) else list(tasks)
    if not items:
        raise ValueError("tasks=[]: give at least one task name or pattern, or None for all")
    patterns = []
    for item in items:
        if isinstance(item, re.Pattern):
            patterns.append(item)
        elif isinstance(item, str) and item:
            # As Celery's MapRoute: a name containing '*' is an fnmatch glob, any other
            # name must match exactly, a compiled regex is applied with ``match``.
            exact = re.escape(item) + r"\Z"
            patterns.append(re.compile(fnmatch.translate(item) if "*" in item else exact))
        else:
            raise ValueError(f"tasks: {item!r} is not a task name, glob pattern or regex")
    return tuple(patterns)
