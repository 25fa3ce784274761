"""What the atomic fetch asks its script (:mod:`.atomic`): keys and arguments of one fetch.

The lists to pop from in order, each with its word (a keyed queue's charge
at fetch), the lists a payload that does not decode is moved to, the keys
of the unacknowledged record, the keys an idle fetch watches, and what rides
on the fetch: key slots released, run-time charges, and the queues whose
scheduled messages (``fair_eta="broker"``) move in when due.
"""

from __future__ import annotations

from time import time
from typing import Any

from .. import compat
from ..keys.layout import KeyedNames
from ..keys.serving import KeyedServing
from ..keys.store import fetch_args
from ..parked import PARKING_SUFFIX

__all__ = ("FetchRequest",)


class FetchRequest:
    """The fetch script's keys and arguments on one Kombu Redis channel."""

    def __init__(self, channel: Any, keyed: KeyedServing | None = None) -> None:
        self.channel = channel
        self.keyed: KeyedServing | None = None
        self.prefix = compat.key_prefix(channel)
        self.sep = compat.key_separator(channel)
        self._malformed: dict[str, str] = {}  # queue key -> its "malformed" list key
        self._unacked = tuple(self.prefix + key for key in compat.unacked_keys(channel))
        # A keyed queue's other Kombu lists (priorities), as suffixes of its name.
        self._suffixes = [
            s
            for s in (compat.queue_key(channel, "", p) for p in compat.priority_steps(channel))
            if s
        ]
        self._default_key_weight = "1.0"
        self._level_words: list[str] = []  # (suffix, weight) pairs: weighted levels
        self._names: dict[str, KeyedNames] = {}  # keyed queue -> its Redis names
        #: Keyed queue -> its charge in the fetch in flight.
        self.charged: dict[str, float] = {}
        self.serve_keyed(keyed)

    def serve_keyed(self, keyed: KeyedServing | None) -> None:
        """Ask for ``keyed``'s queues in fair key order from the next fetch on."""
        self.keyed = keyed
        self._default_key_weight = repr(keyed.terms.default_weight if keyed is not None else 1.0)
        steps = sorted(compat.priority_steps(self.channel))
        weights = keyed.terms.level_weights(steps) if keyed is not None else None
        self._level_words = []
        for step, weight in zip(steps, weights or (), strict=False):
            self._level_words += [compat.queue_key(self.channel, "", step), repr(weight)]

    def queue_of(self, key: str) -> str:
        """The queue a Redis list of the channel belongs to (prefix and priority taken off)."""
        return key[len(self.prefix) :].rsplit(self.sep, 1)[0]

    def command(self, queues: list[str], batch: int = 1) -> list[Any] | None:
        """``EVALSHA``'s key count, keys and arguments for a fetch from ``queues``, in order.

        ``batch``: the most messages to take from the first list.  None when
        no list can be fetched from (every keyed queue at this worker's
        capacity): then nothing is taken to ride on a fetch either.
        """
        keys, words, watched = self._entries(queues)
        if not keys:
            return None
        # Every queue's schedule (fair_eta="broker"): its due messages move in
        # before the pop, and a message scheduled sooner wakes an idle fetch.
        bases = [self.prefix + queue for queue in dict.fromkeys(queues)]
        watched += [self._keyed_names(queue).schedule_next for queue in dict.fromkeys(queues)]
        malformed = [self._malformed_key(key) for key in keys]  # cached per key
        argv = fetch_args(
            words,
            sep=self.sep,
            now=time(),
            default_weight=self._default_key_weight,
            suffixes=self._suffixes,
            level_words=self._level_words,
            charges=self._charges(),
            releases=self._releases(),
            schedules=bases,
            batch=batch,
        )
        count = 2 * len(keys) + 2 + len(watched)
        return [count, *keys, *malformed, *self._unacked, *watched, *argv]

    def _entries(self, queues: list[str]) -> tuple[list[str], list[str], list[str]]:
        """The lists to fetch from in order, each one's word for the script, and watched keys.

        A plain queue has one list per priority (priority first, as Kombu's
        BRPOP); a keyed queue has one entry, at its first place, whose word is
        the charge at fetch (its priority lists are its unkeyed key).  The
        watched keys wake an idle fetch: each keyed queue's active-key set
        and other priority lists.
        """
        channel, prefix, keyed = self.channel, self.prefix, self.keyed
        keys: list[str] = []
        words: list[str] = []
        if keyed is None:
            for pri in compat.priority_steps(channel):
                for queue in queues:
                    keys.append(prefix + compat.queue_key(channel, queue, pri))
            return keys, ["-"] * len(keys), []
        watched: list[str] = []
        charged = self.charged
        charged.clear()
        for pri in compat.priority_steps(channel):
            for queue in queues:
                if queue not in keyed.queues:
                    keys.append(prefix + compat.queue_key(channel, queue, pri))
                    words.append("-")
                elif queue not in charged and keyed.leases.has_room(queue):
                    charged[queue], word = keyed.terms.fetch_word(queue)
                    keys.append(prefix + queue)
                    words.append(word)
                    names = self._keyed_names(queue)
                    watched.append(names.active)
                    for suffix in self._suffixes:  # the other priority levels
                        watched += [names.base + suffix, names.level(suffix).active]
        return keys, words, watched

    def _releases(self) -> list[str]:
        """Key slots to free with this fetch, flat (base, delivery tag)."""
        keyed = self.keyed
        if keyed is None or not keyed.limited:
            return []
        flat: list[str] = []
        for queue, tag in keyed.releases.take():
            flat.extend((self.prefix + queue, tag))
        return flat

    def _keyed_names(self, queue: str) -> KeyedNames:
        found = self._names.get(queue)
        if found is None:
            found = self._names[queue] = KeyedNames(self.prefix + queue, self.sep)
        return found

    def _charges(self) -> list[Any]:
        """Run-time corrections to send with this fetch, flat (base, level, key, delta)."""
        keyed = self.keyed
        if keyed is None or not keyed.terms.runtime:
            return []
        flat: list[Any] = []
        for queue, level, key, user, delta in keyed.counters.take_charges():
            flat.extend((self.prefix + queue, level, key, user, repr(delta)))
        return flat

    def _malformed_key(self, key: str) -> str:
        found = self._malformed.get(key)
        if found is None:
            found = self._malformed[key] = self.prefix + self.queue_of(key) + PARKING_SUFFIX
        return found
