"""Per-key limits on RabbitMQ: limit tokens as messages, and one worker's book of them.

RabbitMQ runs no scripts, so a key's limits there are messages
(docs/fairness-keys.md#limits-on-rabbitmq):

* **Concurrency** ``L``: a queue of ``L`` token messages.  A worker takes
  one (``basic.get``) before a task of the key starts and holds it
  unacknowledged while the task runs; it gives it back (``basic.reject``
  with requeue) when the task ends.  A worker that dies has its tokens given
  back by the broker when its connection closes: crash-safe with no second
  database.
* **Rate** ``r`` per second: a queue of ``n`` tokens; a task spends one
  (rejected without requeue), which is dead-lettered to a wait queue whose
  messages expire after the period and are dead-lettered back.  So at most
  ``n`` tasks start in any period: a sliding window, not Redis's refilling
  bucket.  ``n = round(r)`` over one second from 1/s up, one token over
  ``1/r`` seconds below, and :data:`MAX_RATE_TOKENS` over ``n / r`` seconds
  above that many a second.

The names carry the limit (``jobs.fair.t.c2.<digest of the key>``), so a
changed limit is a new set of tokens and workers with different settings
never share a queue of the wrong size.  This module is pure: names, which
limits apply to a key, and what one worker holds and sets aside.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import FairConfigError
from .lanes import key_digest
from .limits import CONCURRENCY, RATE, KeyLimits, resolve

__all__ = (
    "MAX_CONCURRENCY_TOKENS",
    "MAX_RATE_TOKENS",
    "TOKEN_EXPIRES",
    "HeldToken",
    "TokenBook",
    "TokenSpec",
    "check_concurrency",
    "token_specs",
)

#: Seconds a key's token queue is kept unused (no ``basic.get``) before
#: RabbitMQ deletes it (``x-expires``); its marker goes with it, so the next
#: worker that needs the key mints a new set.
TOKEN_EXPIRES = 24 * 3600.0


@dataclass(frozen=True)
class TokenSpec:
    """The tokens of one limit of one key of keyed ``queue``.

    ``kind`` is :data:`~celery_fair.keys.limits.CONCURRENCY` or
    :data:`~celery_fair.keys.limits.RATE`; ``count`` tokens, and for a rate
    the ``period`` (seconds) a spent token waits before it is back.
    """

    queue: str
    key: str
    kind: str
    count: int
    period: float = 0.0

    @property
    def name(self) -> str:
        """The queue that holds the tokens."""
        digest = key_digest(self.key)
        if self.kind == RATE:
            return f"{self.queue}.fair.t.r{self.count}p{round(self.period * 1000)}.{digest}"
        return f"{self.queue}.fair.t.c{self.count}.{digest}"

    @property
    def wait(self) -> str:
        """A rate's wait queue: spent tokens expire there and come back."""
        return f"{self.name}.wait"

    @property
    def marker(self) -> str:
        """The exchange whose existence says the tokens were minted (bound to :attr:`name`,
        auto-deleted with it)."""
        return f"{self.name}.minted"

    @property
    def mint_lock(self) -> str:
        """An exclusive queue: the one connection declaring it mints."""
        return f"{self.name}.mint"


def token_specs(
    limits: KeyLimits,
    queue: str,
    key: str,
    live: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[TokenSpec, ...]:
    """The limits on ``key`` of keyed ``queue`` as token sets (none: unlimited).

    ``live``: the limits set live on the queue, kind -> key -> value
    (:meth:`~celery_fair.keys.pause_events.PauseState.live`).  A key's
    own entry wins over ``"*"``, a live one over a configured one, as on Redis
    (:func:`~celery_fair.keys.limits.resolve`).
    """
    live = live or {}
    specs: list[TokenSpec] = []
    concurrency = resolve(limits.concurrency, live.get(CONCURRENCY, {}), key)
    if concurrency is not None:
        specs.append(TokenSpec(queue, key, CONCURRENCY, int(concurrency)))
    rate = resolve(limits.rates, live.get(RATE, {}), key)
    if rate is not None:
        count, period = _window(float(rate))
        specs.append(TokenSpec(queue, key, RATE, count, period))
    return tuple(specs)


#: Tokens of one rate at most: a faster rate has a shorter period.
MAX_RATE_TOKENS = 100
#: The largest concurrency limit of one key on RabbitMQ: a limit of ``L`` is
#: ``L`` messages for every key it applies to (``"*"``: every active key), kept
#: until the key has been idle for :data:`TOKEN_EXPIRES`.
MAX_CONCURRENCY_TOKENS = 1_000


def check_concurrency(limits: Mapping[str, float], setting: str) -> None:
    """Refuse a concurrency limit above :data:`MAX_CONCURRENCY_TOKENS` (RabbitMQ's tokens),
    naming ``setting``, the key and the value."""
    for key, limit in limits.items():
        if limit > MAX_CONCURRENCY_TOKENS:
            raise FairConfigError(
                f"{setting}[{key!r}]={limit:g}: on RabbitMQ a concurrency limit is that many "
                f"token messages for each key it applies to; at most {MAX_CONCURRENCY_TOKENS:,} "
                "(leave the key out for no limit)"
            )


def _window(per_second: float) -> tuple[int, float]:
    """A rate as ``(tokens, period)``: ``round(r)`` per second from 1/s, else 1 per 1/r s;
    above :data:`MAX_RATE_TOKENS` per second, that many over a shorter period."""
    if per_second > MAX_RATE_TOKENS:
        return MAX_RATE_TOKENS, MAX_RATE_TOKENS / per_second
    if per_second >= 1.0:
        return max(1, round(per_second)), 1.0
    return 1, 1.0 / per_second


@dataclass(frozen=True)
class HeldToken:
    """A token taken on a channel: its delivery tag and the client's connection generation
    (a token of an earlier connection went back when that connection closed)."""

    spec: TokenSpec
    tag: Any
    generation: int


T = TypeVar("T")


class TokenBook(Generic[T]):
    """What one worker holds and sets aside, by task (not thread-safe: the caller locks).

    A task that has its key's tokens is *held* until it ends; a task whose key
    has none free waits *aside*, in arrival order per key, and no later task of
    that key goes before it.
    """

    def __init__(self) -> None:
        self._held: dict[str, list[HeldToken]] = {}
        self._aside: OrderedDict[tuple[str, str], deque[T]] = OrderedDict()
        self.taken = 0
        self.set_aside = 0
        self.repaired = 0

    # -- held ------------------------------------------------------------------

    def hold(self, task_id: str, tokens: Iterable[HeldToken]) -> None:
        held = list(tokens)
        self._held.setdefault(task_id, []).extend(held)
        self.taken += 1

    def release(self, task_id: str) -> list[HeldToken]:
        """The tokens ``task_id`` held (none if it held none, or gave them back already)."""
        return self._held.pop(task_id, [])

    def holders(self) -> list[str]:
        return list(self._held)

    def held_tasks(self) -> int:
        """Tasks holding tokens now."""
        return len(self._held)

    def holding(self, task_id: str) -> bool:
        """Whether ``task_id`` holds tokens now."""
        return task_id in self._held

    def held_count(self) -> int:
        return sum(len(tokens) for tokens in self._held.values())

    def held_by_key(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tokens in self._held.values():
            for token in tokens:
                counts[token.spec.key] = counts.get(token.spec.key, 0) + 1
        return counts

    def forget_generation(self, generation: int) -> int:
        """The connection of ``generation`` closed: its tokens went back on the broker."""
        dropped = 0
        for task_id in list(self._held):
            kept = [t for t in self._held[task_id] if t.generation != generation]
            dropped += len(self._held[task_id]) - len(kept)
            if kept:
                self._held[task_id] = kept
            else:
                del self._held[task_id]
        return dropped

    # -- aside -----------------------------------------------------------------

    def waiting(self, queue: str, key: str) -> bool:
        """Whether tasks of ``key`` wait aside (a later one waits behind them)."""
        return (queue, key) in self._aside

    def put_aside(self, queue: str, key: str, task: T) -> None:
        self._aside.setdefault((queue, key), deque()).append(task)
        self.set_aside += 1

    def keys_aside(self) -> list[tuple[str, str]]:
        """The keys with tasks aside, longest-waiting key first."""
        return list(self._aside)

    def next_aside(self, queue: str, key: str) -> T | None:
        """The oldest task of ``key`` aside, removed (None: none waits)."""
        waiting = self._aside.get((queue, key))
        if not waiting:
            return None
        task = waiting.popleft()
        if not waiting:
            del self._aside[(queue, key)]
        else:
            # The key goes to the back of the line of keys waiting.
            self._aside.move_to_end((queue, key))
        return task

    def drop_aside(self, keep: Any) -> list[T]:
        """Remove and return the tasks aside for which ``keep(task)`` is false."""
        gone: list[T] = []
        for where in list(self._aside):
            waiting = self._aside[where]
            kept = deque(t for t in waiting if keep(t))
            gone.extend(t for t in waiting if not keep(t))
            if kept:
                self._aside[where] = kept
            else:
                del self._aside[where]
        return gone

    def aside_count(self) -> int:
        return sum(len(waiting) for waiting in self._aside.values())

    def any_aside(self) -> bool:
        """Whether any task waits aside (a key's line is dropped when it empties)."""
        return bool(self._aside)

    def aside_by_key(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (_, key), waiting in self._aside.items():
            counts[key] = counts.get(key, 0) + len(waiting)
        return counts

    def __iter__(self) -> Iterator[T]:
        for waiting in self._aside.values():
            yield from waiting
