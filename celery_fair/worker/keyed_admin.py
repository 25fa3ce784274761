"""The worker's keyed queues on the broker: settings written, backlogs adopted, slots freed.

Everything a worker does to the per-key structures of :mod:`celery_fair.keys`
besides fetching from them (which the fetch script does): it writes the
configured key weights and limits at each connection, serves a keyed backlog
found on a queue ``fair_keys`` does not name (a roll-back), frees the slots of
finished tasks under per-key limits, and answers the live controls.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .. import compat
from ..errors import FairConfigError
from ..keys import store, throttling
from ..keys.layout import KeyedNames
from ..keys.limits import CONCURRENCY
from ..keys.pause_events import WEIGHT, LiveSetting
from ..keys.pause_log import PauseLog, PauseLogUnavailable
from ..keys.publish import names_for
from ..keys.serving import KeyedServing
from ..keys.tokens import check_concurrency
from ..kombu.cycle import connection_errors
from ..scheduling.scheduler import FairScheduler
from .attachment import Attachment
from .settings import FairSettings

__all__ = ("KeyedAdmin",)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class KeyedAdmin:
    """Keyed-queue administration for one worker, through its live channel."""

    def __init__(
        self,
        settings: FairSettings,
        scheduler: FairScheduler,
        attachment: Attachment,
        *,
        probe: compat.Probe,
        slots: int,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.attachment = attachment
        self.probe = probe
        self.slots = slots
        #: Keyed queues this worker marked configured on the broker (see ``publish_settings``).
        self._configured: set[str] = set()
        #: RabbitMQ: the log of paused keys (None on Redis, where a set on the broker
        #: holds them).
        self.pause_log: PauseLog | None = None

    def serving(self) -> KeyedServing | None:
        """The keyed queues of ``fair_keys``, served in fair key order (None without)."""
        settings = self.settings
        if not settings.keys:
            return None
        return KeyedServing(
            settings.keys,
            default_weight=settings.default_key_weight,
            runtime=settings.cost != "count",
            estimate=self.scheduler.fetch_cost,
            limits=settings.key_limits,
            slots=self.slots,
            priority_weights=settings.priority_weights,
        )

    def adopt_backlogs(self, channel: Any, queues: Iterable[str]) -> None:
        """Serve a keyed backlog on a consumed queue that ``fair_keys`` does not name.

        Messages published with a key wait in per-key lists, which only a
        keyed fetch reads.  After ``fair_keys`` is removed from a worker (a
        roll-back, docs/migrating.md) they would wait for ever; served here
        in fair key order with the default key weight, until they are gone.
        """
        keyed = self.attachment.keyed
        known = keyed.queues if keyed is not None else frozenset()
        candidates = [q for q in queues if q not in known]
        if not candidates:
            return
        with compat.redis_client(channel) as client:
            waiting = store.waiting_keyed(client, [names_for(channel, q) for q in candidates])
        found = {q: n for q, n in zip(candidates, waiting, strict=True) if n > 0}
        if not found:
            return
        if keyed is None:
            keyed = self.attachment.keyed = KeyedServing(
                (),
                default_weight=self.settings.default_key_weight,
                runtime=self.settings.cost != "count",
                estimate=self.scheduler.fetch_cost,
                slots=self.slots,
                priority_weights=self.settings.priority_weights,
            )
        keyed.adopt(found)
        fetch = self.attachment.fetch
        if fetch is not None and fetch.channel is channel:
            fetch.serve_keyed(keyed)
        for queue, count in sorted(found.items()):
            logger.warning(
                "celery-fair: queue %r holds %d message(s) published with a key, but fair_keys "
                "does not name it: they are served in fair key order until none is left "
                "(`celery-fair keys unkey %s` moves them back to the queue's own list)",
                queue, count, queue,
            )  # fmt: skip

    def recheck_backlogs(self) -> None:
        """Look again for keyed backlogs on the consumed queues (a timer calls this)."""
        channel, cycle = self.attachment.channel, self.attachment.cycle
        if channel is None or cycle is None or cycle.atomic is None:
            return
        try:
            self.adopt_backlogs(channel, cycle.items)
            keyed = self.attachment.keyed
            if keyed is not None:
                self.tidy(channel, keyed.queues)
        except connection_errors(channel) as exc:
            logger.debug("celery-fair: keyed backlog check skipped (%r)", exc)
        except Exception as exc:
            if not compat.broker_full(exc):
                raise
            logger.debug("celery-fair: keyed queues not tidied, the broker is full (%r)", exc)

    def tidy(self, channel: Any, queues: Iterable[str]) -> store.Tidied:
        """Keep the keyed ``queues``' throttling records true (``tidy.lua``): records
        under an earlier release's names are moved, and keys set aside at a
        concurrency limit they are below go back in line."""
        queues = sorted(queues)
        with compat.redis_client(channel) as client:
            sep = compat.key_separator(channel)
            done = store.tidy(client, sep, [names_for(channel, q).base for q in queues])
        if done.moved:
            logger.info(
                "celery-fair: moved %d throttling record(s) of keyed queue(s) %s from the "
                "names of an earlier release (a rolling upgrade)",
                done.moved, ", ".join(queues),
            )  # fmt: skip
        if done.readmitted:
            logger.info(
                "celery-fair: %d key(s) of keyed queue(s) %s were set aside at a concurrency "
                "limit they are below now and went back in line (a limit raised or removed, "
                "or a slot freed by a worker of an earlier release)",
                done.readmitted, ", ".join(queues),
            )  # fmt: skip
        return done

    def publish_settings(
        self, channel: Any, when_full: Callable[[Callable[[], None], Exception], None]
    ) -> None:
        """Write the configured key weights and limits where the fetch script reads them.

        Called at every connection.  First it says what it found of each keyed
        queue on the broker; a queue this worker configured before and now
        finds unmarked lost its state (:class:`~celery_fair.keys.store.KeyedFound`).
        Key-slot releases that may have been lost with the last connection go
        again.  A full broker refuses the writes: ``when_full(write, exc)``
        makes them later (the broker keeps what the last worker wrote until then).
        """
        if self.attachment.fetch is None:
            raise FairConfigError(
                f"fair_keys={sorted(self.settings.keys)!r} needs the atomic fetch, which is "
                f"not available here ({', '.join(self.probe.missing) or 'not a Redis channel'})"
            )
        try:
            self._write_settings(channel)
        except Exception as exc:
            if not compat.broker_full(exc):
                raise
            when_full(lambda: self._write_settings(channel), exc)
        keyed = self.attachment.keyed
        if keyed is not None and keyed.limited:
            sent = keyed.releases.attach(self.send_releases)
            if sent:
                logger.info(
                    "celery-fair: sent again %d key-slot release(s) the broker may not have "
                    "had when the connection was lost",
                    sent,
                )

    def _write_settings(self, channel: Any) -> None:
        limits = self.settings.key_limits.as_fields()
        with compat.redis_client(channel) as client:
            for queue in self.settings.keys:
                names = names_for(channel, queue)
                self._say_found(queue, store.found(client, names))
                store.write_configured_weights(client, names, self.settings.key_weights)
                store.write_configured_limits(client, names, limits)
                store.keyed_again(client, names)
                store.mark_configured(client, names)
        # After the limits are written: a key they now let go goes back in line.
        self.tidy(channel, self.settings.keys)

    def _say_found(self, queue: str, found: store.KeyedFound) -> None:
        """Log what this connection found of keyed ``queue`` on the broker."""
        again = queue in self._configured
        self._configured.add(queue)
        counts = (
            f"{found.messages} message(s) waiting, {found.in_line} key(s) in line, "
            f"{found.at_limit} at their concurrency limit, {found.sleeping} throttled by their "
            f"rate, {found.paused} paused, {found.leases} task(s) holding a key slot, "
            f"{found.live_settings} live setting(s)"
        )
        if again and not found.configured:
            logger.warning(
                "celery-fair: keyed queue %r lost its state on the broker since this worker's "
                "last connection (a restart without its data, or a failover to a replica "
                "that had not received it); found %s. The configured key weights and limits "
                "are written again; weights, limits and pauses set live are gone, and tasks "
                "running now hold no key slot, so their keys may run over their limits "
                "until those tasks finish",
                queue, counts,
            )  # fmt: skip
        elif found.empty:
            logger.info("celery-fair: keyed queue %r has no state on the broker yet", queue)
        else:
            logger.info(
                "celery-fair: keyed queue %r %s on the broker: %s",
                queue, "found again" if again else "found", counts,
            )  # fmt: skip

    def send_releases(self, releases: list[tuple[str, str]], wake: bool = False) -> None:
        """Free key slots: ``(queue, delivery tag)`` of tasks done with (per-key limits).

        ``wake`` also ends the atomic fetch's idle wait, in the same pipeline.
        """
        channel = self.attachment.channel
        if channel is None:
            raise RuntimeError("no channel")
        sep = compat.key_separator(channel)
        leases = [(names_for(channel, q).base, tag) for q, tag in releases]
        fetch = self.attachment.fetch
        with compat.redis_client(channel) as client:
            # One round trip per finished task, the wake-up (a repeat is harmless) on it.
            store.RELEASE.pipelined(
                client,
                tuple(store.release_args(sep, leases)),
                also=(lambda pipe: fetch.wake(pipe)) if wake and fetch is not None else None,
            )

    def _on_keyed_queues(
        self, setting: str, action: Callable[[Any, KeyedNames], T]
    ) -> dict[str, T]:
        """``action(client, names)`` on each keyed queue, through the consumer's channel."""
        channel = self._keyed_channel(setting)
        with compat.redis_client(channel) as client:
            return {q: action(client, names_for(channel, q)) for q in self.settings.keys}

    def _keyed_channel(self, setting: str) -> Any:
        """The channel of this worker's keyed queues on Redis, or the error of ``setting``."""
        channel = self.attachment.channel
        if self.attachment.keyed is not None and channel is not None:
            return channel
        if self.settings.keys:
            # Keyed queues on RabbitMQ (lanes): no shared state to change on the broker.
            raise FairConfigError(
                f"{setting}: this worker's keyed queues are not on Redis, and {setting} "
                "changes state every worker shares on the broker, which RabbitMQ does not "
                "keep for keys (docs/fairness-keys.md#keys-on-rabbitmq)"
            )
        raise FairConfigError(f"{setting}: this worker has no keyed queue (fair_keys)")

    def set_limits(self, fields: dict[str, str | None]) -> None:
        """Set per-key limits live, on the broker (fields ``c:<key>``, ``r:<key>``).

        On RabbitMQ an event of the control log (:mod:`celery_fair.keys.pause_log`)
        for each keyed queue, which every worker reads.
        """
        if self.pause_log is not None:
            settings = []
            for name, value in fields.items():
                kind, _, key = name.partition(":")  # limits.limit_field's form
                settings.append((kind, key, None if value is None else float(value)))
            self._set_live("fair_key_limits", settings)
            return
        self._on_keyed_queues(
            "fair_key_limits", lambda client, names: store.set_live_limits(client, names, fields)
        )

    def set_weights(self, weights: dict[str, float | None]) -> None:
        """Set key weights live, on the broker (every worker and restart sees them).

        On RabbitMQ an event of the control log, as :meth:`set_limits`.
        """
        if self.pause_log is not None:
            self._set_live("fair_key_weights", [(WEIGHT, k, w) for k, w in weights.items()])
            return
        self._on_keyed_queues(
            "fair_key_weights",
            lambda client, names: store.set_live_weights(client, names, weights),
        )

    def _set_live(self, setting: str, settings: list[LiveSetting]) -> None:
        """RabbitMQ: ``settings`` made live on each keyed queue, through the control log."""
        log = self.pause_log
        assert log is not None
        for _, key, value in settings:
            if value is not None and not math.isfinite(value):
                raise FairConfigError(f"{setting}: {key}={value} is too large")
        check_concurrency(
            {key: value for kind, key, value in settings if kind == CONCURRENCY and value},
            setting,
        )
        written: list[str] = []
        try:
            for queue in sorted(self.settings.keys):
                log.set_live(queue, settings)
                written.append(queue)
        except PauseLogUnavailable as exc:
            raise FairConfigError(f"{setting}: {exc}{_written_before(written)}") from None

    def pause(self, keys: list[str], queue: str | None, paused: bool) -> dict[str, int]:
        """Pause (or resume) ``keys`` in keyed ``queue``, or in every keyed queue of
        this worker; on the broker, so every worker agrees.  Per queue, how many changed."""
        setting = "fair_key_pause" if paused else "fair_key_resume"
        if queue is not None and queue not in self.settings.keys:
            raise FairConfigError(
                f"{setting}: {queue!r} is not a keyed queue of this worker "
                f"(fair_keys: {', '.join(sorted(self.settings.keys)) or 'none'})"
            )

        queues = [queue] if queue is not None else sorted(self.settings.keys)
        if self.pause_log is not None:
            changed: dict[str, int] = {}
            try:
                for q in queues:
                    changed[q] = self.pause_log.append(q, keys, paused)
            except PauseLogUnavailable as exc:
                raise FairConfigError(f"{setting}: {exc}{_written_before(list(changed))}") from None
            return changed
        channel = self._keyed_channel(setting)
        with compat.redis_client(channel) as client:
            changed = {}
            for q in queues:
                names = names_for(channel, q)
                changed[q] = store.pause(client, names.sep, [(names.base, k) for k in keys], paused)
            return changed

    def paused_keys(self) -> dict[str, set[str]] | None:
        """The paused keys of each keyed queue, from the broker (None: not readable now)."""
        log = self.pause_log
        if log is not None:
            # Each read also moves back what keys resumed lately left parked.
            return log.state.paused() if log.read() else None
        channel = self.attachment.channel
        if self.attachment.keyed is None or channel is None:
            return None
        try:
            with compat.redis_client(channel) as client:
                pipe = client.pipeline(transaction=False)
                queues = sorted(self.settings.keys)
                for q in queues:
                    pipe.smembers(names_for(channel, q).paused)
                found = pipe.execute()
        except connection_errors(channel) as exc:
            logger.debug("celery-fair: paused keys not read (%r)", exc)
            return None
        return {q: {store.text(k) for k in keys} for q, keys in zip(queues, found, strict=True)}

    def controls(self) -> dict[str, store.KeyControls]:
        """Each keyed queue's paused keys, largest backlogs and their top users."""
        log = self.pause_log
        if log is not None:
            # RabbitMQ: the pauses from the log; no backlog per key to rank.
            state, now = log.state, log.wall()
            paused = state.paused()
            return {
                q: store.KeyControls(
                    paused={
                        k: max(0.0, now - (state.paused_since(q, k) or now))
                        for k in sorted(paused.get(q, ()))
                    },
                    paused_seconds=state.paused_seconds.get(q, 0.0),
                    pauses=state.pauses.get(q, 0),
                    largest=(),
                    top_users={},
                )  # fmt: skip
                for q in sorted(self.settings.keys)
            }
        if self.attachment.keyed is None or self.attachment.channel is None:
            return {}
        return self._on_keyed_queues("fair_stats", store.controls)

    def limits_state(self) -> dict[str, throttling.KeyedLimitsState]:
        """Each keyed queue's limits in force, running counts and keys throttled."""
        keyed = self.attachment.keyed
        if keyed is None or not keyed.limited or self.attachment.channel is None:
            return {}
        return self._on_keyed_queues("fair_stats", throttling.limits_state)

    def scheduled(self) -> dict[str, int] | None:
        """How many messages wait in each consumed queue's schedule (``fair_eta="broker"``).

        None without ``fair_eta="broker"`` or before the first connection on Redis.
        """
        channel, cycle = self.attachment.channel, self.attachment.cycle
        if self.settings.eta != "broker" or channel is None or cycle is None:
            return None
        queues = sorted(set(cycle.items))
        with compat.redis_client(channel) as client:
            pipe = client.pipeline(transaction=False)  # reads, refused in MULTI over maxmemory
            for q in queues:
                pipe.zcard(names_for(channel, q).schedule)
            counts = pipe.execute()
        return {q: int(n) for q, n in zip(queues, counts, strict=True)}

    def backlogs(self, top: int = 10) -> dict[str, store.KeyedBacklog]:
        """Each keyed queue's waiting messages and next keys, read from the broker."""
        if self.attachment.keyed is None or self.attachment.channel is None:
            return {}
        return self._on_keyed_queues(
            "fair_stats", lambda client, names: store.backlog(client, names, top)
        )


def _written_before(queues: list[str]) -> str:
    """What a command that failed part-way had already made to apply (each event is
    the last word on its queue, so sending the command again is safe)."""
    if not queues:
        return ""
    return f" (already in force on {', '.join(queues)}: send the command again for the rest)"
