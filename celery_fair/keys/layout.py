"""Where a keyed queue lives on Redis, and the headers that carry a key.

A keyed queue ``jobs`` (with Kombu's key prefix, if any) is:

* ``jobs`` and its priority lists (``jobs\\x06\\x163`` ...): Kombu's own lists.
  Messages from producers without celery-fair land here; the fetch serves
  them as one more key, the empty key ``""``.
* ``jobs\\x06\\x16fair.k.<key>``: one list per key with messages waiting,
  LPUSH to publish, RPOP to fetch (publish order within a key, as Kombu).
* ``jobs\\x06\\x16fair.keys``: a sorted set of the keys with messages
  waiting, scored by their virtual start tag; the fetch serves the lowest.
* ``jobs\\x06\\x16fair.sizes``: a sorted set of the keys with messages
  waiting, scored by how many (all levels): the largest backlogs in
  O(log keys), for the exporter (:mod:`celery_fair.monitoring`).
* Priority levels: a keyed message published with a Celery priority waits in
  the level of Kombu's list for that priority.  The first level's names are
  the ones above; level ``jobs\\x06\\x163`` has ``jobs\\x06\\x163\\x06\\x16fair.k.<key>``,
  ``...fair.keys``, ``...fair.last`` and its virtual time in ``...fair.state``.
  ``jobs\\x06\\x16fair.levels`` lists the levels in use; with
  ``fair_priority="weighted"``, ``fair.lt`` holds each level's start tag.
  Everything else (weights, limits, leases, keys set aside, the backlog) is
  the queue's, shared by its levels.
* ``jobs\\x06\\x16fair.last``: finish tags of keys that emptied recently (a
  key that comes back at once resumes at its finish tag, not at the queue's
  virtual time); entries behind the virtual time are dropped at each fetch.
* ``jobs\\x06\\x16fair.state``: a hash: ``vt`` (virtual time),
  ``backlog`` (messages in the per-key lists) and, after ``celery-fair keys
  unkey`` until a worker with ``fair_keys`` for the queue starts,
  ``unkeyed``: keyed publishes and restores then go to Kombu's own list;
  ``configured``: a worker with ``fair_keys`` for the queue has connected
  (how a worker tells that the broker lost the queue's state).
* ``jobs\\x06\\x16fair.wconf`` / ``fair.wlive``: key weights, configured
  (rewritten when a worker starts) and set live (``control fair_key_weights``).
* With per-key limits (:mod:`celery_fair.keys.limits`): ``fair.lconf`` /
  ``fair.llive`` (limits, fields ``c:<key>`` and ``r:<key>``), ``fair.run``
  (tasks fetched and not finished, per key), ``fair.leases`` (task id ->
  expiry) and ``fair.lease`` (task id -> key), ``fair.atlimit`` (keys at
  their concurrency limit, set aside), ``fair.sleep`` (keys set aside by
  their rate, scored by when they may go on) and ``fair.b.<key>`` (a key's
  token bucket, expiring once full again).  A key set aside by either limit
  is *throttled*: ``fair.tsince`` (key -> when it was throttled, while it
  is), ``fair.throttled`` (key -> seconds spent throttled, the
  ``THROTTLED_TOP`` longest kept), and in ``fair.state`` the fields
  ``throttled_n`` (times a key was throttled) and ``throttled_s`` (seconds);
  ``fair.towed`` (key -> seconds it was throttled, not yet reported): the
  next task served of the key carries them in its ``fair_served`` header
  (:data:`celery_fair.wire.SERVED_HEADER`).  Earlier releases named these
  ``fair.parked``, ``fair.hsince``, ``fair.held``, ``fair.howed``,
  ``held_n`` and ``held_s`` (the ``OLD_*`` names below); ``tidy.lua`` moves them.
* Two-level keys (``fair_keys`` with a pair of sources): a key (a tenant) has
  no list of its own but, per level, ``fair.u.<key>`` (its users with
  messages waiting, by start tag), ``fair.ul.<key>`` (their recent finish
  tags), a field in ``fair.uvt`` (their virtual time) and one list per user,
  ``jobs\x06\x16fair.k.<key>\x06\x16<user>``.
* Scheduled messages (``fair_eta = "broker"``, :mod:`celery_fair.keys.eta`), in
  keyed and plain queues alike: ``jobs\x06\x16fair.eta``, a sorted set of
  envelopes (the payload, its priority level, its key and user) scored by
  when each is due; the fetch moves the due ones into the queue
  (``promote.lua``), at most ``ETA_BATCH`` per queue and fetch.
* Paused keys (``control fair_key_pause``): ``fair.paused``, ``fair.psince``
  (since when), ``fair.powed`` (seconds its next served task reports), and in
  ``fair.state`` ``paused_n`` and ``paused_s``.

Kombu's separator (``\\x06\\x16``) is used so that no queue name can collide
with these names: Kombu's priority lists use it followed by a digit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("UNKEYED", "KeyedNames", "level_rank")


#: The key of messages published without one (plain Kombu lists).
UNKEYED = ""

ACTIVE, LAST, STATE, WEIGHTS_CONF, WEIGHTS_LIVE, KEY_LIST = (
    "fair.keys", "fair.last", "fair.state", "fair.wconf", "fair.wlive", "fair.k.",
)  # fmt: skip
LIMITS_CONF, LIMITS_LIVE, RUNNING, LEASES, LEASE_KEY, AT_LIMIT, SLEEP, BUCKET = (
    "fair.lconf", "fair.llive", "fair.run", "fair.leases", "fair.lease", "fair.atlimit",
    "fair.sleep", "fair.b.",
)  # fmt: skip
THROTTLED_SINCE, THROTTLED, THROTTLED_OWED = "fair.tsince", "fair.throttled", "fair.towed"
#: Fields of ``fair.state``: times a key was throttled, and seconds throttled.
THROTTLED_COUNT, THROTTLED_SECONDS = "throttled_n", "throttled_s"
#: The names earlier releases gave the throttling records (old -> new): "held"
#: and "parked" mean other things in celery-fair (a worker's unacknowledged
#: messages; bad input set aside).  ``tidy.lua`` moves what it finds under an
#: old name to the new one, merging with what is there already, at each
#: worker connection and every ``KEYED_RECHECK`` seconds, so that a rolling
#: upgrade (workers of both releases on one queue) loses nothing.  The last
#: two are fields of ``fair.state``.
OLD_AT_LIMIT, OLD_THROTTLED_SINCE, OLD_THROTTLED, OLD_THROTTLED_OWED = (
    "fair.parked", "fair.hsince", "fair.held", "fair.howed",
)  # fmt: skip
OLD_THROTTLED_COUNT, OLD_THROTTLED_SECONDS = "held_n", "held_s"
#: Sorted set: key -> messages waiting in its lists (the exporter's top keys).
SIZES = "fair.sizes"
#: Set: the suffixes of the priority levels keyed messages were published to
#: (Kombu's list suffixes, ``\x06\x163`` ...; the first level, ``""``, is not listed).
LEVELS = "fair.levels"
#: Hash, with ``fair_priority="weighted"``: level suffix -> its start tag, and
#: ``*`` -> the levels' virtual time.
LEVEL_TAGS = "fair.lt"
#: Two-level keys: per level and key (tenant), the sorted set of its users
#: with messages waiting (``fair.u.<key>``, scored by their start tags within
#: the key) and their recent finish tags (``fair.ul.<key>``); per level, the
#: hash key -> its users' virtual time (``fair.uvt``).  A user's list is the
#: key's list name, the separator, then the user.
USERS, USER_LAST, USER_VT = "fair.u.", "fair.ul.", "fair.uvt"
#: Pause (``control fair_key_pause``): the set of paused keys, key -> when it
#: was paused (broker clock), key -> paused seconds its next served task reports.
PAUSED, PAUSED_SINCE, PAUSED_OWED = "fair.paused", "fair.psince", "fair.powed"
#: Fields of ``fair.state``: messages in the per-key lists, and the mark of a
#: queue moved back to plain lists (``celery-fair keys unkey``).
BACKLOG, UNKEYED_MARK = "backlog", "unkeyed"
#: Field of ``fair.state``: set by every worker with ``fair_keys`` for the queue
#: at each connection.  A worker that set it and finds it gone at its next
#: connection knows the broker lost the queue's state (a restart without its
#: data, or a failover to a replica that had not received it).
CONFIGURED_MARK = "configured"
#: Sorted set, per queue (keyed or plain): scheduled messages by due time (``fair_eta``).
SCHEDULE = "fair.eta"
#: Sorted set, per keyed queue: key -> how many of its messages wait in the schedule.
SCHEDULED_KEYS = "fair.etakeys"
#: String, per queue: the due time of a message scheduled ahead of every other, written
#: only then.  Idle fetches watch it, not the schedule: a message due after the
#: next one changes nothing for them (they wake when the next one is due).
SCHEDULE_NEXT = "fair.etanext"
#: The most scheduled messages of one queue a fetch moves into it (due ones, oldest first):
#: a large backlog coming due at once is moved over several fetches, none of them long.
ETA_BATCH = 100
#: How many keys ``fair.throttled`` keeps (the longest throttled); trimmed at twice as many.
THROTTLED_TOP = 1000


def level_rank(level: str) -> int:
    """A level suffix's rank: its priority step (``"\x06\x169"`` -> 9), 0 for the first.

    Levels are served lowest rank first, as Kombu's Redis transport reads its
    priority lists (``level_rank`` in ``prelude.lua`` gives the same order).
    """
    digits = len(level) - len(level.rstrip("0123456789"))
    return int(level[-digits:]) if digits else 0


@dataclass(frozen=True)
class KeyedNames:
    """The Redis names of one keyed queue; ``base`` is the prefixed queue name."""

    base: str
    sep: str = "\x06\x16"

    def _name(self, suffix: str) -> str:
        return f"{self.base}{self.sep}{suffix}"

    @property
    def active(self) -> str:
        return self._name(ACTIVE)

    @property
    def last(self) -> str:
        return self._name(LAST)

    @property
    def state(self) -> str:
        return self._name(STATE)

    @property
    def weights_conf(self) -> str:
        return self._name(WEIGHTS_CONF)

    @property
    def weights_live(self) -> str:
        return self._name(WEIGHTS_LIVE)

    @property
    def limits_conf(self) -> str:
        return self._name(LIMITS_CONF)

    @property
    def limits_live(self) -> str:
        return self._name(LIMITS_LIVE)

    @property
    def running(self) -> str:
        return self._name(RUNNING)

    @property
    def leases(self) -> str:
        return self._name(LEASES)

    @property
    def lease_keys(self) -> str:
        """Hash: lease (delivery tag) -> its key."""
        return self._name(LEASE_KEY)

    @property
    def at_limit(self) -> str:
        return self._name(AT_LIMIT)

    @property
    def sleep(self) -> str:
        return self._name(SLEEP)

    @property
    def throttled_since(self) -> str:
        """Hash: key throttled by its limits -> since when (broker clock)."""
        return self._name(THROTTLED_SINCE)

    @property
    def throttled(self) -> str:
        """Sorted set: key -> seconds it spent throttled by its limits (the longest)."""
        return self._name(THROTTLED)

    @property
    def throttled_owed(self) -> str:
        """Hash: key -> seconds throttled that its next served task reports."""
        return self._name(THROTTLED_OWED)

    @property
    def levels(self) -> str:
        """Set: the suffixes of the priority levels in use (the first, ``""``, unlisted)."""
        return self._name(LEVELS)

    def level(self, suffix: str) -> KeyedNames:
        """The names of priority level ``suffix`` (``""``: the first level, these names)."""
        return self if not suffix else KeyedNames(self.base + suffix, self.sep)

    @property
    def sizes(self) -> str:
        """Sorted set: key -> messages in its list (keys with none are not in it)."""
        return self._name(SIZES)

    def key_list(self, key: str) -> str:
        """The list of ``key``'s waiting messages."""
        return self._name(KEY_LIST) + key

    def users(self, key: str) -> str:
        """Two-level keys: the sorted set of ``key``'s users with messages waiting."""
        return self._name(USERS) + key

    def user_list(self, key: str, user: str) -> str:
        """Two-level keys: the list of ``user``'s waiting messages within ``key``."""
        return self.key_list(key) + self.sep + user

    @property
    def schedule(self) -> str:
        """Sorted set: the queue's scheduled messages (envelopes) by due time."""
        return self._name(SCHEDULE)

    @property
    def schedule_next(self) -> str:
        """String: the due time of the last message scheduled ahead of all others."""
        return self._name(SCHEDULE_NEXT)

    @property
    def scheduled_keys(self) -> str:
        """Sorted set: key -> how many of its messages wait in the schedule."""
        return self._name(SCHEDULED_KEYS)

    @property
    def paused(self) -> str:
        """Set: the paused keys."""
        return self._name(PAUSED)

    @property
    def paused_since(self) -> str:
        """Hash: paused key -> when it was paused (broker clock)."""
        return self._name(PAUSED_SINCE)
