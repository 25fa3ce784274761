"""A weighted consistent-hash ring: map keys to queues, stably and in proportion to weight.

The algorithm is weighted rendezvous hashing ("highest random weight", HRW;
Thaler & Ravishankar, "Using name-based mappings to increase hit rates",
IEEE/ACM ToN 6(1), 1998), in its logarithmic weighted form (Schindelhauer &
Schomaker, "Weighted distributed hash tables", SPAA 2005). For a key *k*, each
queue *q* of weight *w_q* draws a pseudo-random *u(q, k)* in (0, 1) from a
stable hash of the pair and scores ``ln(u) / w_q``; the key goes to the queue
with the highest score.

Why this rather than a ring of virtual nodes (Karger et al., "Consistent
hashing and random trees", STOC 1997), which is what RabbitMQ's
``x-consistent-hash`` exchange uses:

* Exact shares. ``-ln(u) / w_q`` is exponentially distributed with rate *w_q*;
  the minimum of independent exponentials is attained by *q* with probability
  ``w_q / W``. A virtual-node ring only approaches the weights as the number
  of points grows (its arcs have a relative spread of about ``1/sqrt(points)``),
  which is why the broker plugin's distribution is visibly uneven with few
  points.
* Exact minimal disruption, for every change. A key's winner only depends on
  the scores of the queues present, and each score only on (queue, key,
  weight). Adding a queue can only take keys for itself; removing any queue,
  first, middle or last, only frees its own keys; raising a weight only pulls
  keys onto that queue, lowering it only pushes keys off it. No renumbering
  of buckets, no dependence on the order queues were listed or bound in.
* Determinism. Scores come from BLAKE2b, not Python's salted ``hash()``, so
  every process on every machine agrees.

The price is O(n) work per lookup for n queues instead of O(log n). The
per-queue step is a few integer operations (a SplitMix64 finaliser over a
precomputed per-queue seed, Steele et al., OOPSLA 2014) and a ``log``; see
``bench/router.py`` for the measured rate at 4, 16 and 256 queues. Callers
that see the same keys repeatedly can memoise ``lookup`` (the router does).

This module is pure: no Celery, Kombu, I/O or clock.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from hashlib import blake2b

__all__ = (
    "HashRing",
    "RingKey",
    "RingStatistics",
    "canonical_key",
    "ideal_moved_fraction",
    "key_hash",
)

#: The key types a ring accepts. Each has one canonical text form (see ``canonical_key``).
RingKey = str | bytes | int | uuid.UUID

_MASK64 = (1 << 64) - 1
# BLAKE2b personalisation keeps the key hash and the queue seeds in separate domains.
_KEY_PERSON = b"celery-fair-key"
_QUEUE_PERSON = b"celery-fair-q"
# 2**-53: turns the top 53 bits of a 64-bit word into a double in (0, 1).
_TWO_POW_MINUS_53 = 1.0 / (1 << 53)


def canonical_key(key: RingKey) -> str:
    """Return the text form under which ``key`` is hashed.

    ``42``, ``"42"`` and ``b"42"`` are the same key; a UUID is its hyphenated
    lower-case form. That text is also what the router stamps into the message
    header, so hashing the header again gives the same queue. ``bool`` and
    other types are refused: their text forms are either surprising or not
    stable across processes.
    """
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        raise TypeError(f"a ring key must be str, bytes, int or UUID, not bool ({key!r})")
    if isinstance(key, int):
        return str(key)
    if isinstance(key, bytes):
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"a bytes ring key must be valid UTF-8: {key!r}") from None
    if isinstance(key, uuid.UUID):
        return str(key)
    raise TypeError(
        f"a ring key must be str, bytes, int or UUID, not {type(key).__name__} ({key!r})"
    )


def key_hash(key: RingKey) -> int:
    """Return the stable 64-bit hash of ``key`` (BLAKE2b of its canonical UTF-8 text)."""
    data = canonical_key(key).encode("utf-8", "surrogatepass")
    return int.from_bytes(blake2b(data, digest_size=8, person=_KEY_PERSON).digest(), "little")


def _queue_seed(name: str) -> int:
    data = name.encode("utf-8", "surrogatepass")
    return int.from_bytes(blake2b(data, digest_size=8, person=_QUEUE_PERSON).digest(), "little")


def _check_weight(name: str, weight: object) -> float:
    # bool is an int subclass; True as a weight is almost certainly a mistake.
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight of queue {name!r} must be a number, not {weight!r}")
    value = float(weight)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"weight of queue {name!r} must be a positive finite number, not {weight!r}"
        )
    return value


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"queue name must be a non-empty string, not {name!r}")
    return name


def _normalise(queues: Mapping[str, float] | Iterable[str]) -> dict[str, float]:
    if isinstance(queues, (str, bytes)):
        raise TypeError(f"queues must be a mapping or a list of names, not the string {queues!r}")
    weights: dict[str, float] = {}
    if isinstance(queues, Mapping):
        for name, weight in queues.items():
            weights[_check_name(name)] = _check_weight(name, weight)
    else:
        for name in queues:
            if _check_name(name) in weights:
                raise ValueError(f"queue {name!r} is listed twice")
            weights[name] = 1.0
    if not weights:
        raise ValueError("queues must name at least one queue")
    return weights


@dataclass(frozen=True)
class RingStatistics:
    """A snapshot of a ring's configuration: queues in name order and their ideal shares."""

    queues: tuple[str, ...]
    weights: tuple[float, ...]
    total_weight: float
    shares: tuple[float, ...]
    algorithm: str = "weighted-rendezvous"


class HashRing:
    """An immutable weighted rendezvous-hash ring over named queues.

    ``queues`` is a mapping of queue name to positive weight, or an iterable of
    names for equal weights. The result of ``lookup`` depends only on the key
    and on the set of (name, weight) pairs, never on their order. Changes
    return a new ring (``with_queue``, ``without_queue``, ``with_weight``), so a
    ring can be shared between threads without locks.
    """

    __slots__ = ("_weights", "_names", "_seeds", "_inverse_weights", "_table")

    def __init__(self, queues: Mapping[str, float] | Iterable[str]) -> None:
        weights = _normalise(queues)
        # Sorting makes iteration (and the tie-break below) independent of input order.
        self._names: tuple[str, ...] = tuple(sorted(weights))
        self._weights: dict[str, float] = {name: weights[name] for name in self._names}
        self._seeds = tuple(_queue_seed(name) for name in self._names)
        self._inverse_weights = tuple(1.0 / self._weights[name] for name in self._names)
        self._table = tuple(zip(self._seeds, self._inverse_weights, self._names, strict=True))

    @property
    def queues(self) -> tuple[str, ...]:
        """Queue names, sorted."""
        return self._names

    @property
    def weights(self) -> dict[str, float]:
        """A copy of the queue -> weight mapping."""
        return dict(self._weights)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashRing):
            return NotImplemented
        return self._weights == other._weights

    def __hash__(self) -> int:
        return hash(tuple(self._weights.items()))

    def __repr__(self) -> str:
        pairs = ", ".join(f"{name!r}: {weight:g}" for name, weight in self._weights.items())
        return f"HashRing({{{pairs}}})"

    def lookup(self, key: RingKey) -> str:
        """Return the queue that ``key`` belongs to."""
        return self.lookup_hash(key_hash(key))

    def lookup_hash(self, h: int) -> str:
        """Return the queue for a key whose ``key_hash`` is ``h``."""
        log = math.log
        best_score = -math.inf
        best_name = ""
        for seed, inverse_weight, name in self._table:
            # SplitMix64 finaliser of (key hash XOR queue seed): a bijective
            # mixer with full avalanche, so the draws for different queues are
            # independent for practical purposes.
            x = h ^ seed
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
            x ^= x >> 31
            # u in (0, 1): the top 53 bits, shifted half a step off zero.
            score = log(((x >> 11) + 0.5) * _TWO_POW_MINUS_53) * inverse_weight
            # Ties are practically impossible; break them by name so they stay deterministic.
            if score > best_score or (score == best_score and name < best_name):
                best_score = score
                best_name = name
        return best_name

    def with_queue(self, name: str, weight: float = 1.0) -> HashRing:
        """Return a ring with queue ``name`` added (it must not be present)."""
        if name in self._weights:
            raise ValueError(f"queue {name!r} is already in the ring")
        return HashRing({**self._weights, name: weight})

    def without_queue(self, name: str) -> HashRing:
        """Return a ring without queue ``name`` (it must be present, and not the last one)."""
        if name not in self._weights:
            raise KeyError(f"queue {name!r} is not in the ring")
        return HashRing({q: w for q, w in self._weights.items() if q != name})

    def with_weight(self, name: str, weight: float) -> HashRing:
        """Return a ring where queue ``name`` (which must be present) has weight ``weight``."""
        if name not in self._weights:
            raise KeyError(f"queue {name!r} is not in the ring")
        return HashRing({**self._weights, name: weight})

    def shares(self) -> dict[str, float]:
        """Each queue's ideal fraction of keys, ``weight / total weight``."""
        total = math.fsum(self._weights.values())
        return {name: weight / total for name, weight in self._weights.items()}

    def statistics(self) -> RingStatistics:
        """Return the ring's configuration as a frozen record."""
        shares = self.shares()
        return RingStatistics(
            queues=self._names,
            weights=tuple(self._weights[name] for name in self._names),
            total_weight=math.fsum(self._weights.values()),
            shares=tuple(shares[name] for name in self._names),
        )


def ideal_moved_fraction(before: HashRing, after: HashRing) -> float:
    """The least fraction of keys any mapping must move to go from ``before`` to ``after``.

    It is the total variation distance between the two share vectors: keys
    can stay put only up to the smaller of a queue's old and new share.
    """
    old, new = before.shares(), after.shares()
    names = set(old) | set(new)
    return 0.5 * math.fsum(abs(old.get(n, 0.0) - new.get(n, 0.0)) for n in names)
