"""The probe table of the ``"table"`` mapping: its layout, its slots and the lookup.

See :mod:`celery_fair.routing.ring` for the algorithm and its guarantees.
This module is pure: no Celery, Kombu, I/O or clock.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from hashlib import shake_128
from itertools import repeat
from operator import lshift, or_, rshift

from .hashing import GOLDEN, MASK64, MIX1, MIX2, queue_seed

__all__ = ("TABLE_MEMO_SIZE", "ProbeTable", "TableLayout", "probe_table", "table_layout")

# Prefix of the SHAKE-128 input that places a queue's slots (fixed length, so no
# name can collide with another name plus prefix).
_SLOT_DOMAIN = b"celery-fair-slot"
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


class ProbeTable:
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
        self.seeds = tuple(queue_seed(name) for name in names)
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
        mask, mix1, mix2, golden, owner_mask = MASK64, MIX1, MIX2, GOLDEN, _OWNER_MASK
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
def probe_table(
    names: tuple[str, ...], weights: tuple[float, ...], layout: TableLayout
) -> ProbeTable:
    """Build (or reuse) the probe table of ``names`` with ``weights``, laid out as ``layout``.

    A table is never changed after it is built, so rings with the same queues,
    weights and layout can share one, across threads too. ``names`` is sorted
    by the caller, so the order the queues were given in does not split the memo.
    """
    return ProbeTable(names, dict(zip(names, weights, strict=True)), layout)
