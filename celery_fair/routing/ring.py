"""A weighted consistent-hash ring: map keys to queues, stably and in proportion to weight.

Two mappings are implemented; ``HashRing(algorithm=...)`` picks one, and each
name denotes a frozen mapping (pinned-value tests guard both against change):

``"rendezvous"``
    Weighted rendezvous hashing ("highest random weight", HRW; Thaler &
    Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM
    ToN 6(1), 1998) in its logarithmic weighted form (Schindelhauer &
    Schomaker, "Weighted distributed hash tables", SPAA 2005). For a key *k*,
    each queue *q* of weight *w_q* draws *u(q, k)* in (0, 1) from a stable hash
    of the pair and scores ``ln(u) / w_q``; the key goes to the highest score.
    ``-ln(u) / w_q`` is exponential with rate *w_q*, so the shares are exactly
    ``w_q / W``. It costs O(n) per key for n queues.

``"table"``
    A weighted probe table, O(1) per key at any number of queues (see
    ``TableLayout`` and ``ProbeTable``). The key space is cut into
    ``2**b`` buckets. Queue *q* owns ``ceil(kappa * w_q)`` *slots*; slot *j* of
    *q* lies in the bucket named by the top *b* bits of the *j*-th 64-bit word
    of SHAKE-128 of the queue name. A key walks a pseudo-random sequence of
    buckets (the SplitMix64 stream seeded with its hash); in each bucket every
    slot draws a key-dependent coin and passes with probability 1/2 (the
    queue's last, fractional slot with proportionally less); the first bucket
    with a passing slot decides, the passing slot with the smallest normalised
    draw wins. Probing a pseudo-random sequence until an occupied place is hit
    is the idea of DxHash (Dong & Wang, "DxHash: A scalable consistent hash
    based on the pseudo-random sequence", arXiv:2107.07930, 2021); here the
    places are buckets of weighted slots, and the coins make every slot count
    the same however many others share its bucket.

``"auto"`` is rendezvous for up to ``AUTO_RENDEZVOUS_MAX_QUEUES`` queues, where it
is exact and at most about twice as slow as the table, and the table above.  The
default is ``"rendezvous"``: changing a ring's mapping moves keys between queues,
so the faster one is opt-in (docs/routing.md, "Migrating").

What both mappings guarantee:

* Minimal disruption, per key. The winner is the queue (rendezvous) or slot
  (table) with the best value, and a value depends only on the key and on one
  queue's name and weight. Adding a queue can only take keys for itself;
  removing any queue, first, middle or last, only frees its own keys; raising
  a weight only pulls keys onto that queue, lowering it only pushes keys off
  it. No renumbering, no dependence on the order queues are listed in. (A
  change of the table's layout, see ``TableLayout``, is the one exception.)
* Determinism. Every hash is BLAKE2b, SHAKE-128 or SplitMix64 over those, never
  Python's salted ``hash()``, so every process on every machine agrees.
* Shares. Rendezvous shares are exact. The table's are exact in expectation
  over the slot placement; the placement itself leaves each queue a fixed
  relative error of about ``0.6 p / sqrt(slots of the queue)`` for a pass
  probability *p* (see ``table_layout``), which is also what separates a
  moved fraction from its ideal: under 0.6% at 16 queues, 2.6% for the worst
  of 256 queues, and at 10,000 queues (64 slots per unit of weight, *p* =
  1/8) a standard deviation of 0.9% for a queue of weight 1 and about 3% for
  the worst queue (``bench/router.py`` measures it all;
  ``HashRing.mapped_shares`` computes it for any ring).

Why not Maglev (Eisenbud et al., "Maglev: A fast and reliable software network
load balancer", NSDI 2016)? Its table gives exact shares, but filling it is a
round in which every backend takes its next free preferred entry, so removing
one backend shifts the later picks of many others: in ``bench/router.py``,
removing one of 256 weighted queues moved 3.9 to 6.4 times its own share of
keys with a table of 100 x n entries, and 1.6 to 2.9 times with 1,000 x n. A
rendezvous race per bucket with exact quotas did no better in a prototype (2
to 3.4 times at 256 queues): exact balance and per-key minimality do not mix
at a table size proportional to n. The probe table keeps rendezvous hashing's
per-key minimality and pays with the small share error instead.

This module is pure: no Celery, Kombu, I/O or clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..grammar import as_positive
from .hashing import (
    MASK64,
    MIX1,
    MIX2,
    TWO_POW_MINUS_53,
    RingKey,
    canonical_key,
    key_hash,
    queue_seed,
)
from .table import TABLE_MEMO_SIZE, ProbeTable, TableLayout, probe_table, table_layout

__all__ = (
    "ALGORITHMS",
    "AUTO_RENDEZVOUS_MAX_QUEUES",
    "TABLE_MEMO_SIZE",
    "HashRing",
    "RingKey",
    "RingStatistics",
    "TableLayout",
    "canonical_key",
    "ideal_moved_fraction",
    "key_hash",
    "table_layout",
)

#: Accepted values of ``HashRing(algorithm=...)``.
ALGORITHMS = ("auto", "rendezvous", "table")
#: ``algorithm="auto"`` uses rendezvous hashing up to this many queues, the table above.
#: Up to a dozen queues rendezvous costs at most about twice a table lookup, is exact,
#: and leaves deployments of that size with the mapping they had before the table.
AUTO_RENDEZVOUS_MAX_QUEUES = 12


def _check_weight(name: str, weight: object) -> float:
    # bool is an int subclass; True as a weight is almost certainly a mistake.
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight of queue {name!r} must be a number, not {weight!r}")
    value = as_positive(weight)
    if value is None:
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


def _check_algorithm(algorithm: object) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: must be one of {', '.join(ALGORITHMS)}")
    return algorithm


def _check_table_weight(table_weight: object) -> float | None:
    if table_weight is None:
        return None
    if isinstance(table_weight, bool) or not isinstance(table_weight, (int, float)):
        raise TypeError(f"table_weight={table_weight!r}: must be a number or None")
    value = as_positive(table_weight)
    if value is None:
        raise ValueError(f"table_weight={table_weight!r}: must be a positive finite number")
    return value


@dataclass(frozen=True)
class RingStatistics:
    """A snapshot of a ring's configuration: queues in name order and their ideal shares."""

    queues: tuple[str, ...]
    weights: tuple[float, ...]
    total_weight: float
    shares: tuple[float, ...]
    algorithm: str = "weighted-rendezvous"
    table_slots: int = 0
    table_buckets: int = 0
    table_band: int | None = None


class HashRing:
    """An immutable weighted consistent-hash ring over named queues.

    ``queues`` is a mapping of queue name to positive weight, or an iterable of
    names for equal weights. ``algorithm`` is ``"rendezvous"`` (the default),
    ``"table"`` (O(1)) or ``"auto"`` (rendezvous
    for up to ``AUTO_RENDEZVOUS_MAX_QUEUES`` queues, the table above); see the
    module docstring. ``table_weight``
    fixes the total weight a table is laid out for (default: the ring's own
    total), so that a table keeps its layout while queues come and go.

    The result of ``lookup`` depends only on the key and on the set of
    (name, weight) pairs (and the two options), never on their order. Changes
    return a new ring (``with_queue``, ``without_queue``, ``with_weight``) with
    the same options, so a ring can be shared between threads without locks.
    A table is built with its ring (seconds at 10,000 queues) and memoised by
    queue set, weights and layout: the last ``TABLE_MEMO_SIZE`` tables are
    reused by any ring that needs one of them.
    """

    __slots__ = (
        "_algorithm",
        "_names",
        "_requested",
        "_scores",
        "_table",
        "_table_weight",
        "_weights",
    )

    def __init__(
        self,
        queues: Mapping[str, float] | Iterable[str],
        *,
        algorithm: str = "rendezvous",
        table_weight: float | None = None,
    ) -> None:
        weights = _normalise(queues)
        self._requested = _check_algorithm(algorithm)
        self._table_weight = _check_table_weight(table_weight)
        # Sorting makes iteration (and every tie-break) independent of input order.
        self._names: tuple[str, ...] = tuple(sorted(weights))
        self._weights: dict[str, float] = {name: weights[name] for name in self._names}
        seeds = tuple(queue_seed(name) for name in self._names)
        inverse_weights = tuple(1.0 / self._weights[name] for name in self._names)
        self._scores = tuple(zip(seeds, inverse_weights, self._names, strict=True))
        if self._requested == "auto":
            small = len(self._names) <= AUTO_RENDEZVOUS_MAX_QUEUES
            self._algorithm = "rendezvous" if small else "table"
        else:
            self._algorithm = self._requested
        self._table: ProbeTable | None = None
        if self._algorithm == "table":
            total = self._table_weight
            if total is None:
                total = math.fsum(self._weights.values())
                if not math.isfinite(total):
                    raise ValueError("the total weight of the queues is too large")
            weights_in_order = tuple(self._weights[name] for name in self._names)
            self._table = probe_table(self._names, weights_in_order, table_layout(total))

    @property
    def queues(self) -> tuple[str, ...]:
        """Queue names, sorted."""
        return self._names

    @property
    def weights(self) -> dict[str, float]:
        """A copy of the queue -> weight mapping."""
        return dict(self._weights)

    @property
    def algorithm(self) -> str:
        """The mapping in use: ``"rendezvous"`` or ``"table"`` (``"auto"`` resolved)."""
        return self._algorithm

    @property
    def layout(self) -> TableLayout | None:
        """The table's layout, or ``None`` for a rendezvous ring."""
        return None if self._table is None else self._table.layout

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def _identity(self) -> tuple[object, ...]:
        # Two rings map alike exactly when weights, algorithm and layout agree.
        return (self._weights, self._algorithm, self.layout)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashRing):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((tuple(self._weights.items()), self._algorithm, self.layout))

    def __repr__(self) -> str:
        pairs = ", ".join(f"{name!r}: {weight:g}" for name, weight in self._weights.items())
        options = ""
        if self._requested != "auto":
            options += f", algorithm={self._requested!r}"
        if self._table_weight is not None:
            options += f", table_weight={self._table_weight:g}"
        return f"HashRing({{{pairs}}}{options})"

    def lookup(self, key: RingKey) -> str:
        """Return the queue that ``key`` belongs to."""
        return self.lookup_hash(key_hash(key))

    def lookup_hash(self, h: int) -> str:
        """Return the queue for a key whose ``key_hash`` is ``h``."""
        table = self._table
        if table is not None:
            owner = table.find(h)
            if owner >= 0:
                return self._names[owner]
            # Every probe came up empty: rendezvous over all queues decides (it is a per-key
            # rule like the probes, so minimal disruption still holds).
        return self._rendezvous(h)

    def _rendezvous(self, h: int) -> str:
        log = math.log
        best_score = -math.inf
        best_name = ""
        for seed, inverse_weight, name in self._scores:
            # SplitMix64 finaliser of (key hash XOR queue seed): a bijective
            # mixer with full avalanche, so the draws for different queues are
            # independent for practical purposes.
            x = h ^ seed
            x = ((x ^ (x >> 30)) * MIX1) & MASK64
            x = ((x ^ (x >> 27)) * MIX2) & MASK64
            x ^= x >> 31
            # u in (0, 1): the top 53 bits, shifted half a step off zero.
            score = log(((x >> 11) + 0.5) * TWO_POW_MINUS_53) * inverse_weight
            # Ties are practically impossible; break them by name so they stay deterministic.
            if score > best_score or (score == best_score and name < best_name):
                best_score = score
                best_name = name
        return best_name

    def _derive(self, weights: Mapping[str, float]) -> HashRing:
        return HashRing(weights, algorithm=self._requested, table_weight=self._table_weight)

    def with_queue(self, name: str, weight: float = 1.0) -> HashRing:
        """Return a ring with queue ``name`` added (it must not be present)."""
        if name in self._weights:
            raise ValueError(f"queue {name!r} is already in the ring")
        return self._derive({**self._weights, name: weight})

    def without_queue(self, name: str) -> HashRing:
        """Return a ring without queue ``name`` (it must be present, and not the last one)."""
        if name not in self._weights:
            raise KeyError(f"queue {name!r} is not in the ring")
        return self._derive({q: w for q, w in self._weights.items() if q != name})

    def with_weight(self, name: str, weight: float) -> HashRing:
        """Return a ring where queue ``name`` (which must be present) has weight ``weight``."""
        if name not in self._weights:
            raise KeyError(f"queue {name!r} is not in the ring")
        return self._derive({**self._weights, name: weight})

    def shares(self) -> dict[str, float]:
        """Each queue's ideal fraction of keys, ``weight / total weight``."""
        total = math.fsum(self._weights.values())
        return {name: weight / total for name, weight in self._weights.items()}

    def mapped_shares(self) -> dict[str, float]:
        """The fraction of all keys each queue actually receives under this ring's mapping.

        For rendezvous hashing this is ``shares()``: exact by construction. For
        a table it is computed from the slots (see ``ProbeTable.owner_shares``)
        and differs from ``shares()`` by the table's small placement error.
        Because removing a queue moves exactly its own keys and adding one moves
        exactly the keys it wins, ``mapped_shares()[name]`` of the larger ring
        *is* the fraction of keys such a change moves.
        """
        table = self._table
        if table is None:
            return self.shares()
        return dict(zip(self._names, table.owner_shares(len(self._names)), strict=True))

    def statistics(self) -> RingStatistics:
        """Return the ring's configuration as a frozen record."""
        shares = self.shares()
        table = self._table
        return RingStatistics(
            queues=self._names,
            weights=tuple(self._weights[name] for name in self._names),
            total_weight=math.fsum(self._weights.values()),
            shares=tuple(shares[name] for name in self._names),
            algorithm="weighted-rendezvous" if table is None else "probe-table",
            table_slots=0 if table is None else table.slots,
            table_buckets=0 if table is None else table.layout.buckets,
            table_band=None if table is None else table.layout.band,
        )


def ideal_moved_fraction(before: HashRing, after: HashRing) -> float:
    """The least fraction of keys any mapping must move to go from ``before`` to ``after``.

    It is the total variation distance between the two share vectors: keys
    can stay put only up to the smaller of a queue's old and new share.
    """
    old, new = before.shares(), after.shares()
    names = set(old) | set(new)
    return 0.5 * math.fsum(abs(old.get(n, 0.0) - new.get(n, 0.0)) for n in names)
