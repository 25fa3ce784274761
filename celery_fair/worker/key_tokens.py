"""Per-key limits on RabbitMQ in the worker: a task starts with its key's tokens.

Tasks reach the pool through :class:`KeyTokenGate` (prefork: before its
semaphore).  A task of a limited key of a keyed queue takes its key's
tokens first (:mod:`celery_fair.keys.tokens`): with them it goes on, and
gives them back when it ends; without them it waits aside, unacknowledged,
and no later task of its key passes it.  Every :data:`POLL` seconds the
gate tries again for the keys aside, longest-waiting first, and every
:data:`AUDIT` seconds gives back the tokens of tasks this worker no longer
has (a finish that was never reported), so a lost callback cannot keep a
key at its limit.

Tasks of other keys never wait for these: a key without free tokens is
set aside and the next task is considered.

A key's limits are the configured ones (``fair_key_concurrency``,
``fair_key_rate_limit``) overlaid with those set live (``control
fair_key_limits``, read from the control log: :meth:`KeyTokenGate.set_live`).
A changed limit is another set of tokens (:class:`~celery_fair.keys.tokens.TokenSpec`
names carry the limit): tasks holding the old set's tokens give them back
there, later tasks take the new set's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import compat
from ..keys.limits import KeyLimits
from ..keys.token_client import TokenClient
from ..keys.tokens import HeldToken, TokenBook, TokenSpec, token_specs
from .dispatch import Holders, holding_gate
from .roles import SchedulingService

__all__ = ("AUDIT", "POLL", "KeyTokenGate", "TokenStatistics")

logger = logging.getLogger(__name__)

#: Seconds between tries for the keys whose tasks wait aside.
POLL = 0.05
#: Seconds between looks for tokens held by tasks this worker no longer has (a task
#: revoked while it waited for prefork's semaphore ends with no finish reported).
AUDIT = 2.0
#: Tries per poll at most: each is one round trip on the event loop.
_TRIES_PER_POLL = 64


class KeyTokenGate:
    """Holds back a limited key's tasks until its tokens are free, across workers."""

    def __init__(
        self, service: SchedulingService, limits: KeyLimits, client: TokenClient, *, slots: int
    ) -> None:
        self.service = service
        self.limits = limits
        self.client = client
        #: Limited tasks holding tokens here at most: the pool's slots.  A token is
        #: taken as the task goes to the pool's wait, so without this a worker's
        #: backlog would hold tokens other workers could use, and a rate's tokens
        #: would be spent long before their tasks start.
        self.slots = max(1, slots)
        client.on_lost = self._lost
        self._lock = threading.Lock()
        #: Held tokens by :meth:`Holders.key`: a request, never a task id alone.
        self._book: TokenBook[tuple[Callable[[Any], Any], Any]] = TokenBook()
        self._holders = Holders()
        self._specs: dict[tuple[str, str], tuple[TokenSpec, ...]] = {}
        #: Limits set live per keyed queue: kind -> key -> value.
        self._live: Mapping[str, Mapping[str, Mapping[str, float]]] = {}
        self.lost_with_connection = 0
        self._polling = self._again = False

    # -- the way to the pool ---------------------------------------------------------

    def wrap(self, process: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Gate ``process`` (the worker's hand-over to the pool, or to prefork's semaphore).

        With no limit in force (none configured, none set live, none aside) a task
        goes straight on: a task that takes no tokens needs nothing given back.
        """
        gated = holding_gate(process, self.submit, self.finished)

        def tokens_first(request: Any) -> Any:
            if self._idle:
                return process(request)
            return gated(request)

        return tokens_first

    @property
    def _idle(self) -> bool:
        # Read without the lock: a limit set live a moment later applies to the next task.
        return not (self.limits or self._live or self._book.any_aside())

    def _limited(self, request: Any) -> tuple[str, str, tuple[TokenSpec, ...]] | None:
        """The task's keyed queue, key and token sets, if it takes tokens or waits behind
        tasks of its key aside (a limit lifted: they go first, at the next poll).  Only
        asked while the gate is not idle (:meth:`wrap`)."""
        queue_map = self.service.queue_map
        queue = queue_map.queue_of(request)
        if queue is None or queue_map.lanes is None or queue not in queue_map.lanes.keyed:
            return None
        key, _, _ = queue_map.key_of(request, queue)
        if key is None:
            return None
        specs = self._specs_of(queue, key)
        return (queue, key, specs) if specs or self._book.waiting(queue, key) else None

    def _specs_of(self, queue: str, key: str) -> tuple[TokenSpec, ...]:
        """The token sets a task of ``key`` takes now (none: the key is not limited)."""
        with self._lock:
            specs = self._specs.get((queue, key))
            if specs is None:
                specs = token_specs(self.limits, queue, key, self._live.get(queue))
                self._specs[(queue, key)] = specs
            return specs

    def set_live(self, live: Mapping[str, Mapping[str, Mapping[str, float]]]) -> None:
        """The limits set live on each keyed queue (kind -> key -> value), as the control
        log has them: from now on tasks take the tokens of the limits in force."""
        fresh = {q: {k: dict(v) for k, v in kinds.items() if v} for q, kinds in live.items()}
        fresh = {q: kinds for q, kinds in fresh.items() if kinds}
        with self._lock:
            if fresh == self._live:
                return
            self._live = fresh
            self._specs.clear()
        # A key no longer limited, or limited more loosely: its tasks aside go at the
        # next poll, on the consumer's timer (not here: with the solo pool they would
        # run inside the control command, before its reply).

    def submit(self, run: Callable[[Any], Any], request: Any) -> None:
        """Run ``request`` now if its key's tokens are free, else set it aside."""
        limited = self._limited(request)
        if limited is None:
            run(request)
            return
        queue, key, specs = limited
        with self._lock:
            if self._book.waiting(queue, key) or self._book.held_tasks() >= self.slots:
                self._book.put_aside(queue, key, (run, request))
                return
        tokens = self._take(specs)
        if tokens is None:
            with self._lock:
                self._book.put_aside(queue, key, (run, request))
            return
        self._start(run, request, tokens)

    def _take(self, specs: tuple[TokenSpec, ...]) -> list[HeldToken] | None:
        """Every token ``specs`` ask for, or None (and those taken go back)."""
        taken: list[HeldToken] = []
        for spec in specs:
            token = self.client.take(spec)
            if token is None:
                for held in taken:
                    self.client.give_back(held)
                return None
            taken.append(token)
        return taken

    def _start(self, run: Callable[[Any], Any], request: Any, tokens: list[HeldToken]) -> None:
        if tokens:  # none: a task aside whose key's limit was lifted meanwhile
            with self._lock:
                self._book.hold(self._holders.hold(request), tokens)
        run(request)

    def holds(self, request: Any) -> bool:
        """Whether ``request`` holds tokens here (its finish must give them back)."""
        if not self._book.held_tasks():  # read without the lock: none held, none to give
            return False
        key = Holders.key(request)
        with self._lock:
            return self._book.holding(key)

    def finished(self, request: Any) -> None:
        """The task ended (ran, failed, or never reached the pool): its tokens go back."""
        key = Holders.key(request)
        with self._lock:
            tokens = self._book.release(key)
            self._holders.release(key)
        for token in tokens:
            self.client.give_back(token)
        if tokens:
            self.poll()  # a slot here is free: the tasks aside may take it

    # -- on the consumer's timer ---------------------------------------------------------

    def poll(self) -> None:
        """Start the tasks aside whose keys have free tokens now, longest-waiting key first."""
        with self._lock:
            if self._polling:
                self._again = True  # a task finished while starting others (solo)
                return
            self._polling = True
        try:
            while True:
                self._poll_once()
                with self._lock:
                    if not self._again:
                        return
                    self._again = False
        finally:
            with self._lock:
                self._polling = False

    def _poll_once(self) -> None:
        tries = 0
        with self._lock:
            keys = self._book.keys_aside()
        for queue, key in keys:
            if self._park_if_paused(queue, key):
                continue
            while tries < _TRIES_PER_POLL:
                with self._lock:
                    if self._book.held_tasks() >= self.slots:
                        return
                    if not self._book.waiting(queue, key):
                        break
                specs = self._specs_of(queue, key)
                tries += 1
                tokens = self._take(specs)
                if tokens is None:
                    break
                with self._lock:
                    entry = self._book.next_aside(queue, key)
                    # Celery forgets what it received when its connection closes
                    # (the messages went back): such a task is not started here.
                    while entry is not None and not compat.request_counted(entry[1]):
                        entry = self._book.next_aside(queue, key)
                if entry is None:
                    for token in tokens:
                        self.client.give_back(token)
                    break
                run, request = entry
                self._start(run, request, tokens)

    def _park_if_paused(self, queue: str, key: str) -> bool:
        """A paused key's tasks aside go to its parked lane (those the broker refused
        stay aside); True if the key is paused.  Tasks received after the pause
        were parked on receipt: these waited for tokens when it came."""
        pauses = self.service.pauses
        back = pauses.check(queue, key)
        if back is None:
            return False
        from celery.worker.state import task_ready

        with self._lock:
            entries = []
            while (entry := self._book.next_aside(queue, key)) is not None:
                # One Celery forgot with its connection went back already.
                if compat.request_counted(entry[1]):
                    entries.append(entry)
        kept = pauses.send_back(entries, back, lambda entry: entry[1], task_ready)
        with self._lock:
            for entry in kept:
                self._book.put_aside(queue, key, entry)
        return True

    def audit(self) -> None:
        """Give back the tokens of tasks this worker no longer has (and log how many).

        A task's finish may go unreported (a callback lost with a pool
        process, a request Celery dropped with its connection); its tokens
        would hold its key at the limit for ever.  Requests are compared as
        objects (:class:`~.dispatch.Holders`): the task may be here again, received
        anew, waiting aside for the tokens its dropped request holds.
        """
        with self._lock:
            if not self._book.held_tasks() and not self._book.any_aside():
                return  # nothing held, nothing aside: nothing to compare
        try:
            reserved, active, known = compat.worker_requests()
        except RuntimeError:
            return  # the pool's threads changed the sets: next time
        live = self._holders.keys_of((*reserved, *active, *known))
        with self._lock:
            gone = [key for key in self._book.holders() if key not in live]
            tokens = [t for key in gone for t in self._book.release(key)]
            for key in gone:
                self._holders.release(key)
            self._book.repaired += len(gone)
            # Tasks aside that Celery no longer has: it forgets what it had received
            # when its broker connection closes, and the messages went back with
            # the channel.  Started here, they would run twice.
            self._book.drop_aside(lambda entry: Holders.key(entry[1]) in live)
        for token in tokens:
            self.client.give_back(token)
        if gone:
            logger.warning(
                "celery-fair: %d task(s) ended without a reported finish held key limit "
                "tokens (%s); %d token(s) given back",
                len(gone), ", ".join(Holders.task_id(key) for key in gone[:5]), len(tokens),
            )  # fmt: skip

    def reset(self) -> int:
        """The consumer's channel is new: the tasks aside went back to the broker with
        the old one.  Forget them, and give back the tokens of the tasks Celery
        dropped with it (:meth:`audit`); returns how many were aside."""
        with self._lock:
            dropped = self._book.drop_aside(lambda entry: False)
        self.audit()
        return len(dropped)

    def waiting(self) -> list[Any]:
        """The requests waiting aside for their keys' tokens."""
        with self._lock:
            return [request for _, request in self._book]

    def _lost(self, generation: int) -> None:
        with self._lock:
            self.lost_with_connection += self._book.forget_generation(generation)
            self._holders.keep(self._book.holders())

    def statistics(self) -> TokenStatistics:
        with self._lock:
            book = self._book
            return TokenStatistics(
                held=book.held_count(),
                held_by_key=book.held_by_key(),
                aside=book.aside_count(),
                aside_by_key=book.aside_by_key(),
                started=book.taken,
                set_aside=book.set_aside,
                repaired=book.repaired,
                lost_with_connection=self.lost_with_connection,
                mints=self.client.mints,
                broker_errors=self.client.errors + self.client.minter.errors,
                live_limits={
                    q: {k: dict(v) for k, v in kinds.items()} for q, kinds in self._live.items()
                },  # fmt: skip
            )


@dataclass(frozen=True)
class TokenStatistics:
    """One worker's limit tokens (``inspect fair_stats``, under ``key_tokens``)."""

    #: Tokens held by this worker's tasks, in all and per key.
    held: int
    held_by_key: Mapping[str, int]
    #: Tasks waiting aside for their keys' tokens, in all and per key.
    aside: int
    aside_by_key: Mapping[str, int]
    #: Tasks that started with tokens; tasks that were set aside (each time).
    started: int
    set_aside: int
    #: Tasks whose finish went unreported: their tokens were given back by the audit.
    repaired: int
    #: Tokens that went back on the broker with a lost connection.
    lost_with_connection: int
    #: Token sets this worker minted; broker failures of the token connections.
    mints: int
    broker_errors: int
    #: Limits set live (``control fair_key_limits``) per keyed queue: kind (``c``
    #: concurrency, ``r`` tasks per second) -> key -> limit.
    live_limits: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)
