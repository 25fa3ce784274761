"""The Python side of the keyed-queue scripts: publish, restore, purge, weights, sizes.

Each function takes a redis-py client (Kombu's ``channel.client`` or a
pipeline) and a :class:`~celery_fair.keys.layout.KeyedNames`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..wire.replies import text
from . import scripts
from .layout import (
    BACKLOG,
    CONFIGURED_MARK,
    UNKEYED,
    UNKEYED_MARK,
    KeyedNames,
    level_rank,
)

__all__ = (
    "KeyControls",
    "KeyedBacklog",
    "KeyedFound",
    "backlog",
    "controls",
    "enqueue",
    "enqueue_args",
    "fetch_args",
    "found",
    "mark_configured",
    "pause",
    "promote",
    "purge_schedule",
    "refused",
    "schedule",
    "scheduled",
    "scheduled_keys",
    "release",
    "set_live_limits",
    "write_configured_limits",
    "purge",
    "set_live_weights",
    "text",
    "tidy",
    "Tidied",
    "keyed_again",
    "unkey",
    "unschedule",
    "waiting_keyed",
    "write_configured_weights",
)

#: Keys a purge deletes per script call (each call blocks Redis briefly).
PURGE_BATCH = 1000


ENQUEUE, CHARGE, PURGE, RELEASE, UNKEY, PAUSE, TIDY = (
    scripts.ENQUEUE, scripts.CHARGE, scripts.PURGE, scripts.RELEASE, scripts.UNKEY, scripts.PAUSE,
    scripts.TIDY,
)  # fmt: skip

#: Messages ``unkey`` moves per script call (each call blocks Redis briefly).
UNKEY_BATCH = 1000


def enqueue(
    client: Any,
    names: KeyedNames,
    key: str,
    payload: str,
    *,
    front: bool = False,
    level: str = "",
    user: str | None = None,
    cap: int | None = None,
    order: float | None = None,
) -> Any:
    """Put ``payload`` in ``key``'s list (``front``: first in line, for a restore).

    ``level`` is the suffix of the message's priority level (Kombu's list
    suffix for its priority; ``""`` the first level); ``user`` the user
    within a two-level key (None: a one-level key); ``cap`` the key's backlog
    cap (None: none; a restore is never refused); ``order``, for a restore
    to the front, the message's publish time: it goes behind the restored
    messages published before it.  :func:`refused` reads the reply.

    On a pipeline (a Kombu restore runs in a ``MULTI``) the script is sent
    with ``EVAL``: a missing script cannot be loaded from inside a transaction.
    """
    args = enqueue_args(
        names, key, payload, front=front, level=level, user=user, cap=cap, order=order
    )
    if _is_pipeline(client):
        return ENQUEUE.add_to(client, *args)
    return ENQUEUE(client, *args)


def enqueue_args(
    names: KeyedNames,
    key: str,
    payload: str,
    *,
    front: bool = False,
    level: str = "",
    user: str | None = None,
    cap: int | None = None,
    order: float | None = None,
) -> tuple[Any, ...]:
    """The ``ENQUEUE`` script's arguments (for a pipeline or a Kombu publish batch)."""
    args: tuple[Any, ...] = (names.base, names.sep, 1, key, payload, "1" if front else "0", level)
    if user is None and order is None:
        return args if cap is None else (*args, cap)
    args = (*args, "" if cap is None else cap, "" if order is None else repr(order))
    return args if user is None else (*args, user)


def refused(reply: Any) -> int | None:
    """The key's backlog if ``ENQUEUE`` refused the message at its cap, else None."""
    if isinstance(reply, (list, tuple)) and len(reply) == 2 and text(reply[0]) == "full":
        return int(reply[1])
    return None


def charge(
    client: Any, sep: str, default_weight: float, charges: list[tuple[str, str, str, str, float]]
) -> Any:
    """Post-charge run times: ``(base, level suffix, key, user, delta seconds)``
    (``user``: ``""`` for a one-level key)."""
    flat: list[Any] = [sep, repr(default_weight)]
    for base, level, key, user, delta in charges:
        flat.extend((base, level, key, user, repr(delta)))
    return CHARGE(client, *flat)


def release(client: Any, sep: str, releases: list[tuple[str, str]]) -> Any:
    """Free the key slots held by these ``(base, task id)`` leases (unknown ids: nothing).

    On a pipeline (a Kombu restore's ``MULTI``) the script is sent with ``EVAL``.
    """
    flat = release_args(sep, releases)
    if _is_pipeline(client):
        return RELEASE.add_to(client, *flat)
    return RELEASE(client, *flat)


def release_args(sep: str, releases: list[tuple[str, str]]) -> list[Any]:
    """The ``RELEASE`` script's arguments (for ``EVALSHA`` in a pipeline of one's own)."""
    flat: list[Any] = [sep, "1"]
    for base, task_id in releases:
        flat.extend((base, task_id))
    return flat


def fetch_args(
    words: Sequence[str],
    *,
    sep: str,
    now: float,
    default_weight: str = "1.0",
    suffixes: Sequence[str] = (),
    level_words: Sequence[str] = (),
    charges: Sequence[Any] = (),
    releases: Sequence[str] = (),
    schedules: Sequence[str] = (),
    batch: int = 1,
) -> list[Any]:
    """The ``FETCH`` script's arguments (lua/fetch.lua), one word per queue key.

    ``suffixes``: a keyed queue's other priority lists; ``level_words``: flat
    (level suffix, weight) pairs, none for strict priority; ``charges``: flat
    (base, level suffix, key, user, delta) run-time corrections; ``releases``:
    flat (base, delivery tag) key slots to free before the pop; ``schedules``:
    the bases of the queues whose due scheduled messages move in before the pop;
    ``batch``: the most messages to take from the first queue key (above 1, the
    reply is an array of entries).
    """
    return [
        len(words), repr(now), sep, default_weight,
        len(suffixes), *suffixes,
        len(level_words) // 2, *level_words,
        len(charges) // 5, *charges,
        len(releases) // 2, *releases,
        len(schedules), *schedules,
        max(1, int(batch)),
        *words,
    ]  # fmt: skip


def schedule(
    client: Any,
    names: KeyedNames,
    due: float,
    payload: str,
    *,
    level: str = "",
    key: str | None = None,
    user: str | None = None,
    cap: int | None = None,
) -> Any:
    """Put ``payload`` in its queue's schedule, due at ``due`` (epoch seconds).

    ``level``: the suffix of its priority level; ``key`` (and ``user``): a
    keyed message's key, None for a plain one; ``cap``: the key's backlog cap,
    checked against its messages waiting now.  :func:`refused` reads the reply.
    """
    envelope: dict[str, str] = {"l": level, "m": payload}
    if key is not None:
        envelope["k"] = key
        if user is not None:
            envelope["u"] = user
    packed = json.dumps(envelope, ensure_ascii=False, separators=(",", ":"))
    args = (names.base, names.sep, repr(float(due)), packed, key or "", "" if cap is None else cap)
    if _is_pipeline(client):
        return scripts.SCHEDULE.add_to(client, *args)
    return scripts.SCHEDULE(client, *args)


def promote(
    client: Any, names: KeyedNames, *, limit: int, now: float | str | None = None
) -> tuple[int, int]:
    """Move up to ``limit`` due messages of the queue's schedule into the queue.

    ``now``: None for the broker's clock, a time, or ``"+inf"`` (every
    message, due or not).  Returns (moved, left in the schedule).
    """
    moved, left = scripts.PROMOTE(
        client, names.base, names.sep, limit, "" if now is None else str(now)
    )  # fmt: skip
    return int(moved), int(left)


def unschedule(
    client: Any, names: KeyedNames, batch: int = UNKEY_BATCH
) -> Iterator[tuple[int, int]]:
    """Move every message of the queue's schedule into the queue, due or not, batch by batch.

    Each batch is one atomic step (PROMOTE with no due time): a stop half way
    loses and duplicates nothing.  Yields ``(moved, left)``; stops when a batch
    moves nothing or nothing is left.
    """
    while True:
        moved, left = promote(client, names, limit=batch, now="+inf")
        if moved:
            yield moved, left
        if not moved or not left:
            return


def purge_schedule(client: Any, names: KeyedNames) -> int:
    """Delete the queue's schedule (``celery purge``); returns how many messages it held.

    Without ``MULTI`` (a Redis at its ``maxmemory`` refuses transactions): a
    message scheduled between the count and the delete is deleted uncounted.
    """
    pipe = client.pipeline(transaction=False)
    pipe.zcard(names.schedule).delete(names.schedule, names.scheduled_keys, names.schedule_next)
    count, _ = pipe.execute()
    return int(count)


def scheduled(client: Any, names: KeyedNames) -> int:
    """How many messages wait in the queue's schedule."""
    return int(client.zcard(names.schedule))


def scheduled_keys(client: Any, names: KeyedNames, top: int) -> tuple[tuple[str, int], ...]:
    """The ``top`` keys with the most messages in a keyed queue's schedule, with their counts."""
    if top <= 0:
        return ()
    found = client.zrevrange(names.scheduled_keys, 0, top - 1, withscores=True)
    return tuple((text(key), int(count)) for key, count in found)


def write_configured_limits(client: Any, names: KeyedNames, fields: Mapping[str, str]) -> None:
    """Replace the configured per-key limits (fields ``c:<key>``, ``r:<key>``) in one step."""
    replace_hash(client, names.limits_conf, fields)


def set_live_limits(client: Any, names: KeyedNames, fields: Mapping[str, str | None]) -> None:
    """Set limits live (fields ``c:<key>``/``r:<key>``); ``None`` removes a live limit."""
    update_hash(client, names.limits_live, fields)


def purge(client: Any, names: KeyedNames) -> int:
    """Delete every key's waiting messages; returns how many were deleted.

    The queue's own (unkeyed) lists are Kombu's to purge.  Runs in batches
    of :data:`PURGE_BATCH` keys, so a million keys never block Redis for long.
    """
    total = 0
    while True:
        deleted, visited = PURGE(client, names.base, names.sep, PURGE_BATCH)
        total += int(deleted)
        if int(visited) < PURGE_BATCH:
            return total


def waiting_keyed(client: Any, names: list[KeyedNames]) -> list[int]:
    """Messages waiting in the per-key lists of each of these queues (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for each in names:
        pipe.hget(each.state, BACKLOG)
    return [int(n or 0) for n in pipe.execute()]


@dataclass(frozen=True)
class KeyedFound:
    """What a worker finds of a keyed queue's state when it connects."""

    #: Whether a worker with ``fair_keys`` for the queue connected before.
    configured: bool
    #: Messages in the per-key lists.
    messages: int
    #: Keys in line to be served (first priority level), set aside at their
    #: concurrency limit, set aside by their rate, and paused.
    in_line: int
    at_limit: int
    sleeping: int
    paused: int
    #: Tasks holding a key's slot (per-key limits): fetched, not yet released.
    leases: int
    #: Key weights and limits set live (``control fair_key_weights``, ``fair_key_limits``).
    live_settings: int

    @property
    def empty(self) -> bool:
        """Nothing at all: a queue never keyed here, or a broker that lost its data."""
        return not (
            self.configured or self.messages or self.in_line or self.at_limit
            or self.sleeping or self.paused or self.leases or self.live_settings
        )  # fmt: skip


def found(client: Any, names: KeyedNames) -> KeyedFound:
    """A keyed queue's state as a worker finds it when it connects (one round trip)."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(names.state, CONFIGURED_MARK, BACKLOG).zcard(names.active)
    pipe.scard(names.at_limit).zcard(names.sleep).scard(names.paused).zcard(names.leases)
    pipe.hlen(names.weights_live).hlen(names.limits_live)
    (mark, messages), in_line, at_limit, sleeping, paused, leases, wlive, llive = pipe.execute()
    return KeyedFound(
        configured=mark is not None,
        messages=int(messages or 0),
        in_line=int(in_line),
        at_limit=int(at_limit),
        sleeping=int(sleeping),
        paused=int(paused),
        leases=int(leases),
        live_settings=int(wlive) + int(llive),
    )


@dataclass(frozen=True)
class Tidied:
    """What :func:`tidy` did, summed over the queues."""

    #: Throttling records found under an earlier release's names, and moved.
    moved: int
    #: Keys set aside at their concurrency limit, below it now, put back in line.
    readmitted: int


def tidy(client: Any, sep: str, bases: Sequence[str]) -> Tidied:
    """Move earlier releases' throttling records to their names; readmit keys below their limit.

    See ``tidy.lua``.  Safe to run at any time, by any number of workers.
    """
    if not bases:
        return Tidied(0, 0)
    moved, readmitted = TIDY(client, sep, *bases)
    return Tidied(int(moved), int(readmitted))


def mark_configured(client: Any, names: KeyedNames) -> None:
    """A worker with ``fair_keys`` for the queue connected (see :class:`KeyedFound`)."""
    client.hset(names.state, CONFIGURED_MARK, 1)


def keyed_again(client: Any, names: KeyedNames) -> None:
    """Keyed publishing resumes on the queue (a worker with ``fair_keys`` for it started)."""
    client.hdel(names.state, UNKEYED_MARK)


def unkey(
    client: Any,
    names: KeyedNames,
    suffixes: tuple[str, Sequence[str]],
    batch: int = UNKEY_BATCH,
) -> Iterator[tuple[int, int]]:
    """Move a keyed queue's waiting messages back to Kombu's own lists, batch by batch.

    ``suffixes``: the list suffix of a message without a priority, and of
    priorities 0 to 9 (where Kombu puts each).  Yields ``(moved, left)`` after
    each batch, an atomic step; stops when a batch moves nothing.
    """
    unprioritized, by_priority = suffixes
    if len(by_priority) != 10:
        raise ValueError(f"unkey: ten priority suffixes expected, got {len(by_priority)}")
    while True:
        moved, left = UNKEY(client, names.base, names.sep, batch, unprioritized, *by_priority)
        if not int(moved):
            return
        yield int(moved), int(left)


@dataclass(frozen=True)
class KeyedBacklog:
    """What waits in a keyed queue's per-key lists."""

    #: Messages in the per-key lists (the unkeyed ones are in the queue's own lists).
    messages: int
    #: Keys with messages waiting (the unkeyed key included when it has any).
    keys: int
    #: The next keys to be served, in order, with their waiting messages.
    next_keys: tuple[tuple[str, int], ...]


def backlog(client: Any, names: KeyedNames, top: int = 0) -> KeyedBacklog:
    """The per-key backlog of a keyed queue, and its ``top`` next keys.

    With priority levels in use, ``keys`` counts a key once per level it waits
    in, and the next keys are those of the first level with any (strict order).
    """
    pipe = client.pipeline(transaction=False)
    pipe.hget(names.state, BACKLOG).zcard(names.active).smembers(names.levels)
    if top:
        pipe.zrange(names.active, 0, top - 1)
    messages, first_level, others, *first_keys = pipe.execute()
    suffixes = sorted((text(s) for s in others), key=level_rank)
    levels = [names, *(names.level(s) for s in suffixes)]
    counts = [int(first_level or 0)]
    if suffixes:  # a second round trip only for a queue with priority levels
        pipe = client.pipeline(transaction=False)
        for level in levels[1:]:
            pipe.zcard(level.active)
        counts += [int(n or 0) for n in pipe.execute()]
    nxt: tuple[tuple[str, int], ...] = ()
    first = next((lv for lv, n in zip(levels, counts, strict=True) if n), None)
    if top and first is not None:
        listed = first_keys[0] if first is names else client.zrange(first.active, 0, top - 1)
        keys = [text(k) for k in listed]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            # A keyed key's count is all its levels' (and users'): fair.sizes.
            pipe.llen(first.base) if key == UNKEYED else pipe.zscore(names.sizes, key)
        nxt = tuple(zip(keys, (int(n or 0) for n in pipe.execute()), strict=True))
    return KeyedBacklog(messages=int(messages or 0), keys=sum(counts), next_keys=nxt)


def write_configured_weights(client: Any, names: KeyedNames, weights: Mapping[str, float]) -> None:
    """Replace the configured key weights (a worker's ``fair_key_weights``) in one step."""
    replace_hash(client, names.weights_conf, {k: repr(float(v)) for k, v in weights.items()})


def set_live_weights(client: Any, names: KeyedNames, weights: Mapping[str, float | None]) -> None:
    """Set key weights live; ``None`` removes a live weight (back to the configured one)."""
    update_hash(
        client, names.weights_live,
        {k: None if v is None else repr(float(v)) for k, v in weights.items()},
    )  # fmt: skip


def replace_hash(client: Any, name: str, fields: Mapping[str, str]) -> None:
    """Make hash ``name`` hold exactly ``fields``, in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(name)
    if fields:
        pipe.hset(name, mapping=dict(fields))
    pipe.execute()


def update_hash(client: Any, name: str, fields: Mapping[str, str | None]) -> None:
    """Set these fields of hash ``name`` (``None``: delete the field), in one transaction."""
    pipe = client.pipeline(transaction=True)
    for field_name, value in fields.items():
        if value is None:
            pipe.hdel(name, field_name)
        else:
            pipe.hset(name, field_name, value)
    pipe.execute()


def _is_pipeline(client: Any) -> bool:
    return hasattr(client, "execute") and hasattr(client, "command_stack")


def pause(client: Any, sep: str, pairs: Sequence[tuple[str, str]], paused: bool = True) -> int:
    """Pause (or resume) keys: ``(base, key)`` pairs; how many changed."""
    flat: list[Any] = [sep, "1" if paused else "0"]
    for base, key in pairs:
        flat.extend((base, key))
    return int(PAUSE(client, *flat))


@dataclass(frozen=True)
class KeyControls:
    """A keyed queue's paused keys and largest backlogs, for ``inspect fair_stats``."""

    #: Paused key -> seconds it has been paused so far (broker clock).
    paused: dict[str, float]
    #: Seconds keys spent paused before they were resumed, and how many pauses.
    paused_seconds: float
    pauses: int
    #: The keys with the most messages waiting (all levels), most first.
    largest: tuple[tuple[str, int], ...]
    #: Two-level keys among those: their users with the most messages waiting
    #: (first priority level), most first.
    top_users: dict[str, tuple[tuple[str, int], ...]]


#: How many users of a key ``controls`` looks at for its top users.
USERS_SCAN = 100


def controls(client: Any, names: KeyedNames, top: int = 5, users: int = 3) -> KeyControls:
    """Paused keys, the ``top`` largest backlogs and each one's ``users`` largest users."""
    pipe = client.pipeline(transaction=False)
    pipe.smembers(names.paused).hgetall(names.paused_since).time()
    pipe.hmget(names.state, "paused_s", "paused_n")
    pipe.zrevrange(names.sizes, 0, top - 1, withscores=True)
    members, since, (secs, micros), (paused_s, paused_n), largest = pipe.execute()
    now = int(secs) + int(micros) / 1e6
    started = {text(k): float(v) for k, v in since.items()}
    paused = {text(k): round(max(0.0, now - started.get(text(k), now)), 3) for k in members}
    biggest = tuple((text(k), int(n)) for k, n in largest)
    pipe = client.pipeline(transaction=False)
    for key, _ in biggest:
        pipe.zrange(names.users(key), 0, USERS_SCAN - 1)
    listed = pipe.execute() if biggest else []
    top_users: dict[str, tuple[tuple[str, int], ...]] = {}
    for (key, _), found in zip(biggest, listed, strict=True):
        if not found:
            continue
        who = [text(u) for u in found]
        pipe = client.pipeline(transaction=False)
        for user in who:
            pipe.llen(names.user_list(key, user))
        counts = sorted(zip(who, (int(n) for n in pipe.execute()), strict=True),
                        key=lambda item: -item[1])  # fmt: skip
        top_users[key] = tuple(counts[:users])
    return KeyControls(
        paused=paused,
        paused_seconds=round(float(paused_s or 0), 3),
        pauses=int(paused_n or 0),
        largest=biggest,
        top_users=top_users,
    )
