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
    ``w_q / W``. It is the mapping every release before the table had, and it
    costs O(n) per key for n queues.

``"table"``
    A weighted probe table, O(1) per key at any number of queues (see
    ``TableLayout`` and ``_ProbeTable``). The key space is cut into
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
default stays ``"rendezvous"``, the mapping of earlier releases: a new mapping
moves keys, so it is opt-in (docs/routing.md, "Migrating").

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
import sys
import uuid
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b, shake_128
from itertools import repeat
from operator import lshift, or_, rshift

from ..grammar import as_positive

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

#: The key types a ring accepts. Each has one canonical text form (see ``canonical_key``).
RingKey = str | bytes | int | uuid.UUID

#: Accepted values of ``HashRing(algorithm=...)``.
ALGORITHMS = ("auto", "rendezvous", "table")
#: ``algorithm="auto"`` uses rendezvous hashing up to this many queues, the table above.
#: Up to a dozen queues rendezvous costs at most about twice a table lookup, is exact,
#: and leaves deployments of that size with the mapping they had before the table.
AUTO_RENDEZVOUS_MAX_QUEUES = 12

_MASK64 = (1 << 64) - 1
# BLAKE2b personalisation keeps the key hash and the queue seeds in separate domains.
_KEY_PERSON = b"celery-fair-key"
_QUEUE_PERSON = b"celery-fair-q"
# Prefix of the SHAKE-128 input that places a queue's slots (fixed length, so no
# name can collide with another name plus prefix).
_SLOT_DOMAIN = b"celery-fair-slot"
# 2**-53: turns the top 53 bits of a 64-bit word into a double in (0, 1).
_TWO_POW_MINUS_53 = 1.0 / (1 << 53)
# SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
# generators", OOPSLA 2014): the stream increment and the finaliser's multipliers.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# A second odd constant, so that two slots of one queue in one bucket draw different coins.
_COPY_STRIDE = 0xD6E8FEB86659FD93
# A table entry is ``bucket << 24 | owner``: the owner is the queue's index in name order.
_OWNER_BITS = 24
_OWNER_MASK = (1 << _OWNER_BITS) - 1
# Most a layout lowers a slot's pass probability to: 1/16 (see ``table_layout``).
_MAX_PASS_BITS = 4
# A key makes at most ``_PROBES_PER_PASS << pass_bits`` probes (probability below 1e-10
# for any layout, see ``TableLayout``), then falls back to rendezvous over all queues.
_PROBES_PER_PASS = 32
#: How many built probe tables are kept, keyed by queue set, weights and layout. A table
#: of 10,000 queues takes seconds to build and about 20 MB, and a process often builds
#: the same one again: a router per task group over the same shards, a ring changed and
#: changed back. A few entries cover that without holding on to many large tables.
TABLE_MEMO_SIZE = 4


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


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit words with full avalanche."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


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
class TableLayout:
    """The shape of a probe table, chosen from a total weight by ``table_layout``.

    Total weights fall into bands ``[3 * 4**(band - 1), 3 * 4**band)``; every
    ring whose total weight (or ``table_weight``) lies in one band has the same
    layout, and changes inside a band move only the keys that must move. A
    change that crosses a band boundary (3, 12, 48, 192, 768, 3072, 12288,
    49152, ...) re-draws every slot, like resizing a Maglev table.

    Inside a band the buckets hold on average between 0.75 and 3 slots. A
    slot passes a probe with probability ``p = 2**-pass_bits``, so a probe
    finds a passing slot with probability at least ``1 - exp(-0.75 p)``: at
    most 3.2 probes are expected at ``p = 1/2``, 5.8 at 1/4, 11 at 1/8 and 22
    at 1/16, and ``32 / p`` probes fail together with probability below 1e-10.
    """

    band: int
    """Index of the band: total weights in ``[3 * 4**(band - 1), 3 * 4**band)``."""
    slots_per_weight: float
    """Slots per unit of weight (a power of two): queue q owns ``ceil(slots_per_weight * w_q)``."""
    bucket_bits: int
    """The table has ``2**bucket_bits`` buckets."""
    pass_bits: int = 1
    """A slot passes a probe with probability ``2**-pass_bits`` (see ``table_layout``)."""

    @property
    def band_top(self) -> float:
        """The (exclusive) upper total weight of the band."""
        return math.ldexp(3.0, 2 * self.band)

    @property
    def buckets(self) -> int:
        """Number of buckets, ``2**bucket_bits``."""
        return 1 << self.bucket_bits


def table_layout(total_weight: float) -> TableLayout:
    """Return the probe-table layout for rings of total weight ``total_weight``.

    The slots per unit weight are a power of two chosen per band: high enough
    at small totals that shares are right to a few tenths of a percent (about
    196,000 slots at the top of each band up to 192), 1,024 per unit up to a
    total of 768, then halving or quartering with each band (256 per unit up
    to 12,288, 64 up to 49,152) so that the table stays under 3.2 million
    slots. The bucket count is the slots per unit times ``4**band``, which
    keeps 0.75 to 3 slots per bucket.

    Where there are fewer slots per unit weight, a slot passes a probe less
    often, ``2**-pass_bits`` with ``pass_bits = 6 - exponent // 2`` between 1
    and 4: 1/2 up to a total of 768, 1/4 up to 12,288, 1/8 up to 49,152. Why:
    slots in one bucket compete for the probe, so a slot that shares its
    bucket decides fewer probes than one alone, by about half the pass
    probability per neighbour. That is what gives a queue's share its error,
    about ``sqrt(load) * p / 2 / sqrt(slots)``; halving *p* halves it, and costs
    probes. At 10,000 queues (64 slots per unit) *p* = 1/2 left a queue of
    weight 1 a share error of 3.5% (standard deviation) and the worst queue
    12%; *p* = 1/8 gives 0.9% and 3% (``bench/router.py``), for about four
    probes more per key.
    """
    if not math.isfinite(total_weight) or total_weight <= 0:
        raise ValueError(f"total weight {total_weight!r} must be a positive finite number")
    # The band is the smallest j with total < 3 * 4**j; ldexp keeps the bounds exact.
    band = math.floor(math.log(total_weight / 3.0, 4)) + 1
    while total_weight >= math.ldexp(3.0, 2 * band):
        band += 1
    while band > -1074 and total_weight < math.ldexp(3.0, 2 * band - 2):
        band -= 1
    # Log2 of the slots per unit weight. 16 - 2j keeps 2**17.6 slots at the band top for
    # small totals; min(10, 14 - j) is a floor of 1024 per unit, halving per band from
    # band 5; 20 - 2j caps the table at 3 * 2**20 slots.
    exponent = min(20 - 2 * band, max(16 - 2 * band, min(10, 14 - band)))
    if exponent > 1000:
        # ldexp(1, 1024) is infinite; no sensible set of weights gets here.
        raise ValueError(f"total weight {total_weight!r} is too small for a table; scale it up")
    return TableLayout(
        band=band,
        slots_per_weight=math.ldexp(1.0, exponent),
        bucket_bits=max(0, exponent + 2 * band),
        pass_bits=min(_MAX_PASS_BITS, max(1, 6 - exponent // 2)),
    )


def _divide_linear(poly: list[float], b: float) -> list[float]:
    """Coefficients of ``poly(u) / (1 - b u)`` for a ``poly`` that has that factor."""
    quotient = [poly[0]]
    for coefficient in poly[1:-1]:
        quotient.append(coefficient + b * quotient[-1])
    return quotient


class _ProbeTable:
    """The slots of a ``"table"`` ring, grouped by bucket, and the probing lookup.

    ``entries`` holds ``bucket << 24 | owner`` for every slot, sorted, and
    ``start[b]:start[b + 1]`` is bucket *b*'s range of it. Two slots of one
    queue in one bucket are equal entries; their coins differ by their rank
    among the equal entries (``copy``), which depends on that queue alone.
    ``partial`` maps the entry of each queue's fractional last slot to its rank
    and to its pass threshold (``passing`` times the fraction). A coin below
    ``passing`` passes.
    """

    __slots__ = ("entries", "layout", "partial", "passing", "probes", "seeds", "shift", "start")

    def __init__(
        self, names: tuple[str, ...], weights: Mapping[str, float], layout: TableLayout
    ) -> None:
        if len(names) > _OWNER_MASK + 1:
            raise ValueError(f"a table ring holds at most {_OWNER_MASK + 1} queues")
        shift = 64 - layout.bucket_bits
        self.layout = layout
        self.shift = shift
        self.passing = 1 << (64 - layout.pass_bits)
        self.probes = _PROBES_PER_PASS << layout.pass_bits
        self.seeds = tuple(_queue_seed(name) for name in names)
        values: list[int] = []
        partial: dict[int, tuple[int, int]] = {}
        for owner, name in enumerate(names):
            expected = layout.slots_per_weight * weights[name]
            full = math.floor(expected)
            fraction = expected - full
            count = full + (1 if fraction > 0.0 else 0)
            words = array("Q")
            domain = _SLOT_DOMAIN + name.encode("utf-8", "surrogatepass")
            words.frombytes(shake_128(domain).digest(8 * count))
            if sys.byteorder == "big":
                words.byteswap()  # the words are little-endian by definition
            buckets = list(map(rshift, words, repeat(shift)))
            if fraction > 0.0:
                last = buckets[-1]
                # The fractional slot is the last-ranked copy in its bucket; raising the
                # weight turns it into a full slot without changing any other coin.
                rank = buckets.count(last) - 1
                partial[last << _OWNER_BITS | owner] = (rank, int(fraction * self.passing))
            # Each queue adds a sorted run; sorting runs is what Timsort does fastest.
            values.extend(
                sorted(map(or_, map(lshift, buckets, repeat(_OWNER_BITS)), repeat(owner)))
            )
        values.sort()
        step = 1 << _OWNER_BITS
        bounds = range(0, (layout.buckets + 1) * step, step)
        self.start = array("I", map(bisect_left, repeat(values), bounds))
        self.entries = array("Q", values)
        self.partial = partial

    @property
    def slots(self) -> int:
        return len(self.entries)

    def owner_shares(self, queues: int) -> list[float]:
        """The exact fraction of all key hashes each owner receives (up to the fallback).

        A probe lands in a bucket uniformly at random. Given that, slot *i*
        (pass probability ``b_i``) wins if it passes and no other slot passes
        with a smaller normalised draw *u*: ``b_i * integral_0^1 prod_{j != i}
        (1 - b_j u) du``. The bucket decides with probability ``1 - prod_j (1 - b_j)``,
        so an owner's share is the sum over its slots divided by the mean of
        that over buckets. The 64-probe fallback (probability below 1e-10) is
        left out. Costs O(slots) in Python: seconds for 10,000 queues.
        """
        shares = [0.0] * queues
        undecided = 0.0  # sum over buckets of P(no slot passes)
        entries = self.entries
        start = self.start
        partial = self.partial
        buckets = self.layout.buckets
        empty = buckets
        for bucket in range(buckets):
            lo = start[bucket]
            hi = start[bucket + 1]
            if lo == hi:
                continue
            empty -= 1
            owners: list[int] = []
            passes: list[float] = []
            previous = -1
            copy = 0
            for position in range(lo, hi):
                entry = entries[position]
                if entry == previous:
                    copy += 1
                else:
                    previous = entry
                    copy = 0
                fractional = partial.get(entry)
                threshold = self.passing
                if fractional is not None and fractional[0] == copy:
                    threshold = fractional[1]
                owners.append(entry & _OWNER_MASK)
                passes.append(threshold / 2.0**64)
            # Coefficients of prod_j (1 - b_j u), lowest degree first.
            poly = [1.0]
            for b in passes:
                poly = [c - b * p for c, p in zip([*poly, 0.0], [0.0, *poly], strict=True)]
            undecided += math.fsum(poly)  # prod_j (1 - b_j), the value at u = 1
            for owner, b in zip(owners, passes, strict=True):
                # prod_{j != i} = poly / (1 - b u): synthetic division, then integrate.
                quotient = _divide_linear(poly, b)
                integral = math.fsum(c / (k + 1) for k, c in enumerate(quotient))
                shares[owner] += b * integral
        undecided += empty
        decided = buckets - undecided
        return [share / decided for share in shares]

    def find(self, h: int) -> int:
        """Return the owner index for key hash ``h``, or -1 if every probe came up empty."""
        start = self.start
        entries = self.entries
        seeds = self.seeds
        partial = self.partial
        shift = self.shift
        passing = self.passing
        # Module constants as locals: a probe costs a few dozen integer operations, and
        # at 1/8 pass probability a key makes several probes.
        mask, mix1, mix2, golden, owner_mask = _MASK64, _MIX1, _MIX2, _GOLDEN, _OWNER_MASK
        x = h  # the key hash is itself uniform: it serves as the first probe word
        z = h
        for probe in range(self.probes):
            if probe:
                # The probe-th output of SplitMix64 seeded with the key hash.
                z += golden
                x = z & mask
                x = ((x ^ (x >> 30)) * mix1) & mask
                x = ((x ^ (x >> 27)) * mix2) & mask
                x ^= x >> 31
            bucket = x >> shift
            position = start[bucket]
            end = start[bucket + 1]
            if position == end:
                continue
            if end - position == 1:
                # A bucket with one slot is the common case; spare it the bookkeeping.
                entry = entries[position]
                y = x ^ seeds[entry & owner_mask]
                y = ((y ^ (y >> 30)) * mix1) & mask
                y = ((y ^ (y >> 27)) * mix2) & mask
                y ^= y >> 31
                if y < passing:
                    fractional = partial.get(entry) if partial else None
                    if fractional is None or y < fractional[1]:
                        return entry & owner_mask
                continue
            winner = -1
            winner_draw = 0
            winner_threshold = 1
            previous = -1
            copy = 0
            while position < end:
                entry = entries[position]
                position += 1
                if entry == previous:
                    copy += 1
                else:
                    previous = entry
                    copy = 0
                owner = entry & owner_mask
                # The coin of (slot, key, probe): the bucket's probe word, the queue's
                # seed and the slot's rank, mixed. Nothing here depends on other queues.
                y = x ^ seeds[owner]
                if copy:
                    y ^= (copy * _COPY_STRIDE) & mask
                y = ((y ^ (y >> 30)) * mix1) & mask
                y = ((y ^ (y >> 27)) * mix2) & mask
                y ^= y >> 31
                if y >= passing:
                    continue
                threshold = passing
                if partial:
                    fractional = partial.get(entry)
                    if fractional is not None and fractional[0] == copy:
                        threshold = fractional[1]
                        if y >= threshold:
                            continue
                # A passing draw is uniform below its threshold; the smallest draw
                # relative to its threshold wins, compared exactly in integers.
                if winner < 0 or y * winner_threshold < winner_draw * threshold:
                    winner = owner
                    winner_draw = y
                    winner_threshold = threshold
            if winner >= 0:
                return winner
        return -1


@lru_cache(maxsize=TABLE_MEMO_SIZE)
def _probe_table(
    names: tuple[str, ...], weights: tuple[float, ...], layout: TableLayout
) -> _ProbeTable:
    """Build (or reuse) the probe table of ``names`` with ``weights``, laid out as ``layout``.

    A table is never changed after it is built, so rings with the same queues,
    weights and layout can share one, across threads too. ``names`` is sorted
    by the caller, so the order the queues were given in does not split the memo.
    """
    return _ProbeTable(names, dict(zip(names, weights, strict=True)), layout)


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
    names for equal weights. ``algorithm`` is ``"rendezvous"`` (the default, the
    mapping of earlier releases), ``"table"`` (O(1)) or ``"auto"`` (rendezvous
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
        seeds = tuple(_queue_seed(name) for name in self._names)
        inverse_weights = tuple(1.0 / self._weights[name] for name in self._names)
        self._scores = tuple(zip(seeds, inverse_weights, self._names, strict=True))
        if self._requested == "auto":
            small = len(self._names) <= AUTO_RENDEZVOUS_MAX_QUEUES
            self._algorithm = "rendezvous" if small else "table"
        else:
            self._algorithm = self._requested
        self._table: _ProbeTable | None = None
        if self._algorithm == "table":
            total = self._table_weight
            if total is None:
                total = math.fsum(self._weights.values())
                if not math.isfinite(total):
                    raise ValueError("the total weight of the queues is too large")
            weights_in_order = tuple(self._weights[name] for name in self._names)
            self._table = _probe_table(self._names, weights_in_order, table_layout(total))

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
            x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
            x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
            x ^= x >> 31
            # u in (0, 1): the top 53 bits, shifted half a step off zero.
            score = log(((x >> 11) + 0.5) * _TWO_POW_MINUS_53) * inverse_weight
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
        a table it is computed from the slots (see ``_ProbeTable.owner_shares``)
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
