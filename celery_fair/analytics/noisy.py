"""Noisy tenants: the fairness keys that take more than their part, and what to do.

Two kinds of rule, each with a threshold in :class:`NoisyRules`:

- **Over the whole report**, from ``key_shares`` rows: a key that took at
  least ``share_of_all`` of all served cost, or ``share_of_queue`` of its
  queue's, or ``hot_factor`` times its even part of its queue (the report's
  older "hot key" rule, which misses a flood that shares its queue with few
  others).
- **Per window**, after Amazon SQS fair queues, which call a tenant a noisy
  neighbour when it holds more than 10% of the queue's in-flight messages (and
  at least 30 of them) or more than 10% of the consumers' recent processing
  time: here, a key's share of the window's *in-flight work* (task-seconds
  between receive and finish; over the window's length, its mean number of
  tasks held by the workers) and of its *processing time* (run time). The
  shares are over all the work of the window, not one queue's: the workers
  are what the tenants compete for.

Every rule also requires the share to be at least ``excess`` times an even
split (1 / the number of keys in that scope), so an even workload flags
nobody, whatever the number of keys, and a key alone in its queue is not
"noisy in its queue". Tasks without a key are never flagged and are not a
key of the even split, but their work counts in every total.

The Spark transforms (``transforms.noisy_keys`` and
``transforms.noisy_windows``) return the flagged rows only, a handful;
:func:`findings` turns them into the report's findings, with the periods
when a key was noisy and the advice that follows. This module is plain
Python (no PySpark), so the command line can read the rules cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from celery_fair.routing.isolation import NOISY_MESSAGES, NOISY_SHARE

__all__ = ("DEFAULT_RULES", "NoisyRules", "advice", "findings")

#: Names of the rules, as they appear in a finding's ``rules``.
SHARE_OF_ALL = "share-of-all"
SHARE_OF_QUEUE = "share-of-queue"
HOT_IN_QUEUE = "hot-in-queue"
IN_FLIGHT = "in-flight"
PROCESSING_TIME = "processing-time"


@dataclass(frozen=True)
class NoisyRules:
    """When a fairness key counts as a noisy tenant (checked when built).

    ``share_of_all``: at least this share of all served cost. ``share_of_queue``:
    at least this share of its queue's served cost. ``hot_factor``: at least this
    many times its even part of its queue (1 / keys in the queue).
    ``in_flight_share`` / ``processing_share``: more than this share of a
    window's in-flight work / processing time (SQS: 10%), in a window where the
    key has at least ``min_tasks`` records. ``min_in_flight``: the in-flight
    rule also needs the key to hold at least this many tasks at once on
    average over the window (SQS asks for 30 messages in flight; a Celery
    worker holds its pool's slots and prefetch, far fewer), so a quiet key's
    handful of tasks never counts, however unevenly they fall. ``min_windows``:
    a key is reported for a stretch of at least this many consecutive noisy
    windows (SQS judges "recent" use, smoothed over time, not one sample): a
    quiet key twice its even share in one window by chance is not reported.
    ``excess``: every share must also be at least this many times an even split
    between the keys of its scope.
    """

    share_of_all: float = 0.25
    share_of_queue: float = 0.5
    hot_factor: float = 5.0
    in_flight_share: float = NOISY_SHARE
    processing_share: float = NOISY_SHARE
    min_tasks: int = NOISY_MESSAGES
    min_in_flight: float = 1.0
    min_windows: int = 2
    excess: float = 1.5

    def __post_init__(self) -> None:
        for name in ("share_of_all", "share_of_queue", "in_flight_share", "processing_share"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name}={value!r}: must be a share in (0, 1]")
        for name in ("hot_factor", "excess"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 1:
                raise ValueError(f"{name}={value!r}: must be a number >= 1")
        for name in ("min_tasks", "min_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if not isinstance(self.min_in_flight, (int, float)) or not self.min_in_flight >= 0:
            raise ValueError(f"min_in_flight={self.min_in_flight!r}: must be a number >= 0")

    def as_dict(self) -> dict[str, float]:
        """The thresholds as a plain record (the report's ``meta.noisy_rules``)."""
        return asdict(self)


#: The defaults, documented in docs/analytics.md.
DEFAULT_RULES = NoisyRules()


def _periods(windows: Iterable[Mapping[str, Any]], window_seconds: float) -> list[dict[str, Any]]:
    """Consecutive flagged windows of one key merged into [start, end) periods."""
    periods: list[dict[str, Any]] = []
    for w in sorted(windows, key=lambda r: r["window"]):
        last = periods[-1] if periods else None
        # Window starts are multiples of window_seconds: compare with a tolerance.
        if last is not None and math.isclose(w["window"], last["end"], abs_tol=1e-6):
            last["end"] = w["window"] + window_seconds
            last["windows"] += 1
            last["in_flight_share"] = max(last["in_flight_share"], w["in_flight_share"] or 0.0)
            last["processing_share"] = max(last["processing_share"], w["processing_share"] or 0.0)
        else:
            periods.append(
                {
                    "start": w["window"],
                    "end": w["window"] + window_seconds,
                    "windows": 1,
                    "in_flight_share": w["in_flight_share"] or 0.0,
                    "processing_share": w["processing_share"] or 0.0,
                }
            )
    return periods


def advice(
    queue: str, key: str, rules: Iterable[str], keys_in_queue: int | None, keyed: bool = False
) -> list[str]:
    """What to do about a noisy key, most useful first (``keyed``: its queue has fair_keys)."""
    found = set(rules)
    out: list[str] = []
    if keyed:
        out.append(
            f"{queue} is keyed already: its other keys are served in turn; lower {key}'s "
            f"weight (fair_key_weights = {{{key!r}: 0.5}}) or cap it with per-key limits"
        )
    elif keys_in_queue == 1:
        out.append(
            f"{key} has queue {queue} to itself: its share of the workers is {queue}'s weight; "
            f"lower it in fair_weights to give the other queues more"
        )
    else:
        out.append(
            f"route {key} to a queue of its own (ConsistentHashRouter(..., isolate=...) does it "
            f"while it is noisy), or use fairness keys on {queue} "
            f"(fair_keys = {{{queue!r}: ...}}) so its other tenants are served in turn"
        )
    if PROCESSING_TIME in found:
        out.append(
            f"{key}'s tasks take a large part of the run time: fair_cost = 'runtime' "
            f"charges run time rather than task count"
        )
    if IN_FLIGHT in found:
        out.append(
            f"cap the tasks of {key} held at once with fair_key_concurrency = {{{key!r}: N}}"
            + ("" if keyed else " (on a keyed queue)")
        )
    return out


def share_across(row: Mapping[str, Any], totals: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A key row's share of all work over every queue that served it, and how many queues.

    ``totals`` maps a key to its ``transforms.across_queues`` row; a key
    without one was served by its row's queue only.
    """
    total = totals.get(row["fair_key"], {})
    return {
        "share_all_queues": total.get("share_all_queues", row["share"]),
        "queues": total.get("queues", 1),
    }


def findings(
    keys: Iterable[Mapping[str, Any]],
    windows: Iterable[Mapping[str, Any]],
    window_seconds: float,
    known_keys: Iterable[Mapping[str, Any]] = (),
    min_windows: int = 1,
    across: Iterable[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """One finding per noisy (queue, key): the rules it broke, when, and advice.

    ``keys`` are ``transforms.noisy_keys`` rows, ``windows``
    ``transforms.noisy_windows`` rows; ``known_keys`` (``key_shares`` rows)
    give the shares of a key that broke only a per-window rule. Stretches of
    fewer than ``min_windows`` consecutive noisy windows are left out (and a
    key with nothing else against it). ``across`` (``transforms.across_queues``
    rows) give a key's share of all work over every queue that served it
    (``share_all_queues``, ``queues``). Largest share of all served cost first.
    """
    known = {(k["queue"], k["fair_key"]): k for k in known_keys}
    found: dict[tuple[str, str], dict[str, Any]] = {}

    def entry(queue: str, key: str) -> dict[str, Any]:
        if (queue, key) not in found:
            base = known.get((queue, key), {})
            found[(queue, key)] = {
                "queue": queue,
                "fair_key": key,
                "share": base.get("share"),
                "share_in_queue": base.get("share_in_queue"),
                "keys_in_queue": base.get("keys_in_queue"),
                "rules": [],
                "noisy_windows": 0,
                "periods": [],
            }
        return found[(queue, key)]

    for row in keys:
        e = entry(row["queue"], row["fair_key"])
        e.update(
            share=row["share"],
            share_in_queue=row["share_in_queue"],
            keys_in_queue=row["keys_in_queue"],
        )
        for flag, name in (
            ("share_of_all", SHARE_OF_ALL),
            ("share_of_queue", SHARE_OF_QUEUE),
            ("hot_in_queue", HOT_IN_QUEUE),
        ):
            if row[flag]:
                e["rules"].append(name)
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in windows:
        by_key.setdefault((row["queue"], row["fair_key"]), []).append(row)
    for (queue, key), rows in by_key.items():
        periods = [p for p in _periods(rows, window_seconds) if p["windows"] >= min_windows]
        if not periods:
            continue
        e = entry(queue, key)
        e["periods"] = periods
        kept = [r for r in rows if any(p["start"] <= r["window"] < p["end"] for p in periods)]
        e["noisy_windows"] = len(kept)
        for flag, name in (("in_flight", IN_FLIGHT), ("processing_time", PROCESSING_TIME)):
            if any(r[flag] for r in kept) and name not in e["rules"]:
                e["rules"].append(name)

    keyed = {k["queue"] for k in known.values() if k.get("keyed")}
    totals = {t["fair_key"]: t for t in across}
    out = []
    for e in found.values():
        e.update(share_across(e, totals))
        e["advice"] = advice(
            e["queue"], e["fair_key"], e["rules"], e["keys_in_queue"], e["queue"] in keyed
        )
        out.append(e)
    out.sort(key=lambda e: (-(e["share"] or 0.0), e["queue"], e["fair_key"]))
    return out
