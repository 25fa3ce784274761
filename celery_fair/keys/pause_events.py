"""Paused keys and live settings on RabbitMQ: the control log's events and their state (pure).

RabbitMQ keeps no state a worker could read for keys, and a pause must hold
for every worker, those started later included.  So pauses are events in a
log every worker reads from its start: a RabbitMQ stream
(:data:`PAUSE_LOG`, ``x-queue-type: stream``), which each reader consumes
from its first retained event without taking it from the others, then live.
The workers that answer ``control fair_key_pause`` (and ``celery fair keys
pause``) append the event; replaying the log in order gives every reader
the same paused keys, last event winning per key.

Per-key limits and key weights set live (``control fair_key_limits``,
``fair_key_weights``) are events of the same log, for the same reasons: an
event with no keys to pause and its settings (``settings``, each ``[kind,
key, value or null]``: :data:`~celery_fair.keys.limits.CONCURRENCY`,
:data:`~celery_fair.keys.limits.RATE` or :data:`WEIGHT`).  A reader of an
earlier version takes it for a marker and skips it.  The last value per
queue, kind and key wins; null removes it (the configured value applies
again).

A paused key's tasks that reach a worker wait apart, in the key's own
**parked lane** (:func:`parked_lane`), which no worker consumes; on resume
the workers move them back to the key's shard lane.  The I/O is in
:mod:`celery_fair.keys.pause_log`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .lanes import key_digest
from .limits import CONCURRENCY, RATE

__all__ = (
    "PAUSE_LOG",
    "PAUSE_LOG_ARGUMENTS",
    "PauseEvent",
    "PauseState",
    "WEIGHT",
    "LiveSetting",
    "parked_lane",
)

#: The stream of pause and resume events (one per virtual host).
PAUSE_LOG = "fair.pauses"
#: The stream's retention: events are about 100 bytes, so 50 MB keeps the
#: last ~500,000 pause and resume commands (and the markers of worker starts).
PAUSE_LOG_ARGUMENTS: Mapping[str, object] = {
    "x-queue-type": "stream",
    "x-max-length-bytes": 50_000_000,
    "x-stream-max-segment-size-bytes": 5_000_000,
}


def parked_lane(queue: str, key: str) -> str:
    """The queue where the tasks of ``key`` in keyed ``queue`` wait while it is paused."""
    return f"{queue}.fair.p.{key_digest(key)}"


#: The kind of a key weight set live (limits are ``CONCURRENCY`` and ``RATE``).
WEIGHT = "w"
#: A setting made live: ``(kind, key, value)``, kind ``"c"`` (concurrency), ``"r"``
#: (tasks per second) or ``"w"`` (the key's weight); value None removes it.
LiveSetting = tuple[str, str, float | None]


@dataclass(frozen=True)
class PauseEvent:
    """One entry of the log: ``keys`` of ``queue`` paused (or resumed) at ``at``
    (wall seconds), or ``settings`` of ``queue`` made live.  ``id`` tells its
    writer when it has read its own entry back; an entry with neither is a
    reader's marker (it has read the log up to there)."""

    id: str
    queue: str = ""
    keys: tuple[str, ...] = ()
    paused: bool = True
    at: float = 0.0
    settings: tuple[LiveSetting, ...] = ()

    def to_body(self) -> bytes:
        fields: dict[str, object] = {"id": self.id, "queue": self.queue, "keys": list(self.keys),
                                     "paused": self.paused, "at": self.at}  # fmt: skip
        if self.settings:
            fields["settings"] = [list(setting) for setting in self.settings]
        return json.dumps(fields).encode()

    @classmethod
    def from_body(cls, body: bytes | str) -> PauseEvent:
        """The event ``body`` holds; :class:`ValueError` naming what is wrong if none."""
        try:
            raw = json.loads(body)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not JSON: {body[:80]!r}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"not an object: {raw!r:.80}")
        id_, queue, keys = raw.get("id"), raw.get("queue"), raw.get("keys")
        paused, at = raw.get("paused"), raw.get("at")
        if (
            not isinstance(id_, str) or not isinstance(queue, str)
            or not isinstance(paused, bool) or not isinstance(at, (int, float))
            or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)
        ):  # fmt: skip
            raise ValueError(f"not a pause event: {raw!r:.120}")
        return cls(id_, queue, tuple(keys), paused, float(at), _settings(raw.get("settings", [])))


def _settings(raw: object) -> tuple[LiveSetting, ...]:
    """An event's ``settings`` list, checked: ``[kind, key, value > 0 or null]`` each."""
    if not isinstance(raw, list):
        raise ValueError(f"settings: not a list: {raw!r:.80}")
    out: list[LiveSetting] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise ValueError(f"settings: not [kind, key, value]: {item!r:.80}")
        kind, key, value = item
        if kind not in (CONCURRENCY, RATE, WEIGHT):
            continue  # a kind of a later version: its readers apply it
        valid = value is None or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        )
        if kind == CONCURRENCY and valid and value is not None and value != int(value):
            valid = False  # a number of tasks at once
        if not isinstance(key, str) or not valid:
            raise ValueError(f"settings: not [kind, key, value]: {item!r:.80}")
        out.append((kind, key, None if value is None else float(value)))
    return tuple(out)


@dataclass
class PauseState:
    """The paused keys the log's events add up to, and when each key last changed."""

    #: (queue, key) -> (paused, wall seconds of its last event).
    keys: dict[tuple[str, str], tuple[bool, float]] = field(default_factory=dict)
    #: Events read, and bodies that were not events (skipped).
    events: int = 0
    malformed: int = 0
    #: Per keyed queue: pauses so far, and seconds keys spent paused before a resume.
    pauses: dict[str, int] = field(default_factory=dict)
    paused_seconds: dict[str, float] = field(default_factory=dict)
    #: Settings made live: (queue, kind, key) -> value.
    settings: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def apply(self, event: PauseEvent) -> list[tuple[str, str]]:
        """Add ``event``; the (queue, key) pairs whose paused state it changed."""
        self.events += 1
        changed = []
        queue = event.queue
        for kind, key, value in event.settings:
            if value is None:
                self.settings.pop((queue, kind, key), None)
            else:
                self.settings[(queue, kind, key)] = value
        for key in event.keys:
            pair = (queue, key)
            before = self.keys.get(pair)
            if before is not None and before[0] == event.paused:
                continue  # a repeat keeps the first time
            if before is None and not event.paused:
                continue  # a resume of a key never paused
            self.keys[pair] = (event.paused, event.at)
            changed.append(pair)
            if event.paused:
                self.pauses[queue] = self.pauses.get(queue, 0) + 1
            elif before is not None:
                spent = max(0.0, event.at - before[1])
                self.paused_seconds[queue] = self.paused_seconds.get(queue, 0.0) + spent
        return changed

    def live(self, queue: str) -> dict[str, dict[str, float]]:
        """The settings made live on keyed ``queue``: kind -> key -> value."""
        found: dict[str, dict[str, float]] = {}
        for (q, kind, key), value in self.settings.items():
            if q == queue:
                found.setdefault(kind, {})[key] = value
        return found

    def paused(self) -> dict[str, set[str]]:
        """Per keyed queue, its paused keys."""
        found: dict[str, set[str]] = {}
        for (queue, key), (paused, _) in self.keys.items():
            if paused:
                found.setdefault(queue, set()).add(key)
        return found

    def paused_since(self, queue: str, key: str) -> float | None:
        """When ``key`` of ``queue`` was paused (None: it is not)."""
        state = self.keys.get((queue, key))
        return state[1] if state is not None and state[0] else None

    def resumed(self, since: float, queues: Iterable[str]) -> list[tuple[str, str]]:
        """The keys of ``queues`` resumed at or after ``since`` (wall seconds)."""
        wanted = set(queues)
        return [
            pair for pair, (paused, at) in self.keys.items()
            if not paused and at >= since and pair[0] in wanted
        ]  # fmt: skip
