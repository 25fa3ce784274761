"""Per-key limits on the worker: the slots its tasks hold and their releases (no broker)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_fair.keys.leases import LOOKAHEAD_BELOW, Leases
from celery_fair.keys.limits import KeyLimits
from celery_fair.keys.releases import ReleaseOutbox
from celery_fair.keys.serving import KeyedServing

Release = tuple[str, str]
ONE_EACH = KeyLimits(concurrency={"*": 1})


class _Fetch:
    """A fetch that carries releases while ``follows``, and counts its wake-ups."""

    def __init__(self, follows: bool = False) -> None:
        self.follows = follows
        self.wakes = 0

    def will_fetch(self) -> bool:
        return self.follows

    def wake(self, pipe: Any = None) -> None:
        self.wakes += 1


class _Sender:
    """Records what it sends, ``(queue, tag)`` and each send's ``wake``; fails while ``broken``."""

    def __init__(self) -> None:
        self.sent: list[Release] = []
        self.wakes: list[bool] = []
        self.broken = False

    def __call__(self, releases: list[Release], wake: bool) -> None:
        if self.broken:
            raise ConnectionError("broker away")
        self.sent.extend(releases)
        self.wakes.append(wake)


def _limited(sender: _Sender | None = None, fetch: _Fetch | None = None) -> KeyedServing:
    """A worker with one pool slot serving keyed queue ``jobs``, one task per key."""
    serving = KeyedServing(["jobs"], limits=ONE_EACH)
    if sender is not None:
        serving.releases.attach(sender)
    serving.fetched_by(fetch)
    return serving


# -- ReleaseOutbox ------------------------------------------------------------


def test_a_release_made_before_any_sender_is_sent_once_one_is_attached() -> None:
    outbox = ReleaseOutbox()
    outbox.release("jobs", "early", wake=False)  # no sender, no fetch: kept, not dropped
    outbox.flush()
    assert outbox.unsent == 1 and outbox.released == 0
    sender = _Sender()
    assert outbox.attach(sender) == 1
    assert sender.sent == [("jobs", "early")] and outbox.unsent == 0 and outbox.released == 1
    assert outbox.attach(sender) == 0 and sender.sent == [("jobs", "early")]  # sent once


def test_without_a_sender_a_release_that_should_wake_the_fetch_still_wakes_it() -> None:
    outbox, fetch = ReleaseOutbox(), _Fetch()
    outbox.fetched_by(fetch)
    outbox.release("jobs", "t1", wake=True)
    outbox.release("jobs", "t2", wake=False)
    assert fetch.wakes == 1 and outbox.unsent == 2


def test_a_release_rides_on_the_fetch_that_follows_until_its_reply() -> None:
    outbox, fetch, sender = ReleaseOutbox(), _Fetch(follows=True), _Sender()
    outbox.attach(sender)
    outbox.fetched_by(fetch)
    outbox.release("jobs", "t1", wake=True)  # the fetch that carries it needs no wake-up
    assert sender.sent == [] and fetch.wakes == 0
    assert outbox.take() == [("jobs", "t1")] and outbox.take() == []
    outbox.lost([])  # the connection broke before the fetch's reply
    assert outbox.unsent == 1
    outbox.release("jobs", "t2", wake=False)
    outbox.take()
    outbox.confirm()  # this one's reply came
    outbox.lost([])
    assert outbox.attach(sender) == 1 and sender.sent == [("jobs", "t1")]


def test_another_threads_release_waits_for_the_busy_fetch_and_never_for_long() -> None:
    outbox, fetch, sender = ReleaseOutbox(), _Fetch(follows=False), _Sender()
    outbox.attach(sender)
    outbox.fetched_by(fetch)  # will_fetch False: a pool thread's release
    outbox.release("jobs", "t0", wake=True)  # no fetch sent yet: goes at once
    assert sender.sent == [("jobs", "t0")]
    outbox.open_carry()  # the fetch thread sent a fetch
    outbox.release("jobs", "t1", wake=True)
    assert sender.sent == [("jobs", "t0")] and outbox.take() == [("jobs", "t1")]
    outbox.release("jobs", "t2", wake=False)
    outbox.flush_if_stuck()  # a fetch took releases since the last look: not stuck
    assert sender.sent == [("jobs", "t0")]
    outbox.flush_if_stuck()  # no fetch since: t2 goes on its own
    assert sender.sent == [("jobs", "t0"), ("jobs", "t2")]
    # The carry is closed until the fetch thread sends its next fetch.
    outbox.release("jobs", "t3", wake=True)
    assert sender.sent[-1] == ("jobs", "t3") and sender.wakes[-1] is True
    outbox.open_carry()
    outbox.release("jobs", "t4", wake=False)
    outbox.flush()  # the fetch thread is about to wait for work: t4 goes first
    assert sender.sent[-1] == ("jobs", "t4") and outbox.take() == []


def test_a_fetch_no_longer_attached_carries_nothing() -> None:
    outbox, sender = ReleaseOutbox(), _Sender()
    outbox.attach(sender)
    outbox.fetched_by(_Fetch(follows=True))
    outbox.fetched_by(None)
    outbox.release("jobs", "t1", wake=False)
    assert sender.sent == [("jobs", "t1")] and outbox.take() == []


def test_releases_kept_for_the_next_connection_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery_fair.keys import releases

    monkeypatch.setattr(releases, "MAX_UNSENT_RELEASES", 3)
    outbox, sender = ReleaseOutbox(), _Sender()
    for i in range(5):
        outbox.release("jobs", f"t{i}", wake=False)
    assert outbox.unsent == 3
    outbox.attach(sender)
    assert [tag for _, tag in sender.sent] == ["t2", "t3", "t4"]  # the oldest went first


# -- Leases -------------------------------------------------------------------


def test_without_limits_nothing_holds_a_slot() -> None:
    outbox, sender = ReleaseOutbox(), _Sender()
    outbox.attach(sender)
    leases = Leases(["jobs"], outbox)
    assert not leases.limited
    leases.fetched("jobs")
    leases.dispatched("jobs", "t1")
    leases.finished("jobs", "t1", 0.5)
    leases.settled("jobs", "t2")
    assert leases.held("jobs") == 0 and leases.has_room("jobs") and sender.sent == []


def test_only_the_keyed_queues_tasks_release_a_slot_and_adopted_queues_are_keyed() -> None:
    outbox, sender = ReleaseOutbox(), _Sender()
    outbox.attach(sender)
    leases = Leases(["jobs"], outbox, limits=ONE_EACH)
    leases.settled("plain", "p1")  # a plain queue's message: no lease to free
    leases.settled(None, "p2")
    assert sender.sent == []
    leases.adopt(["backlog"])
    leases.settled("backlog", "b1")
    assert sender.sent == [("backlog", "b1")] and leases.queues == {"jobs", "backlog"}


def test_a_recount_gives_back_the_slots_of_lost_releases_and_wakes_the_fetch() -> None:
    outbox, fetch = ReleaseOutbox(), _Fetch()
    outbox.fetched_by(fetch)
    leases = Leases(["jobs"], outbox, limits=ONE_EACH, slots=2)
    leases.fetched("jobs")
    leases.fetched("jobs")
    assert not leases.has_room("jobs")
    assert leases.recount("jobs", 2) == 0 and fetch.wakes == 0  # nothing lost
    assert leases.recount("jobs", 1) == 1
    assert leases.held("jobs") == 1 and leases.has_room("jobs") and fetch.wakes == 1


# -- the parts together (KeyedServing) ---------------------------------------------


def test_a_slot_is_freed_when_the_task_finishes_not_at_an_early_ack() -> None:
    sender = _Sender()
    leases = _limited(sender).leases
    leases.dispatched("jobs", "t1")
    leases.settled("jobs", "t1")  # early ack: the pool accepted it, it still runs
    assert sender.sent == []
    leases.finished("jobs", "t1")
    assert sender.sent == [("jobs", "t1")]
    assert leases._tags == {}


def test_a_late_ack_after_the_finish_does_not_release_twice() -> None:
    sender = _Sender()
    leases = _limited(sender).leases
    leases.dispatched("jobs", "t1")
    leases.finished("jobs", "t1")
    leases.settled("jobs", "t1")  # acks_late: the ack follows the finish
    assert sender.sent == [("jobs", "t1")] and leases._tags == {}


def test_a_task_acked_without_running_frees_its_slot() -> None:
    sender = _Sender()
    serving = _limited(sender)
    serving.leases.settled("jobs", "revoked-1")  # revoked, expired or returned by CoDel
    assert sender.sent == [("jobs", "revoked-1")]
    assert serving.statistics().released == 1


def test_a_full_worker_wakes_its_fetch_with_the_release_in_one_round_trip() -> None:
    sender, fetch = _Sender(), _Fetch()
    serving = _limited(sender, fetch)
    leases = serving.leases
    serving.served("jobs", "k")  # one pool slot (slots=1): now full
    assert not leases.has_room("jobs")
    leases.dispatched("jobs", "t1")
    leases.finished("jobs", "t1")
    assert sender.sent == [("jobs", "t1")] and sender.wakes == [True]
    assert fetch.wakes == 0  # the wake-up rode on the release
    assert leases.has_room("jobs")
    leases.settled("jobs", "t2")  # not full: the fetch is not idle for want of room
    assert sender.wakes == [True, False]


def test_a_release_rides_on_the_next_fetch_when_one_follows() -> None:
    sender, fetch = _Sender(), _Fetch(follows=True)
    serving = _limited(sender, fetch)
    leases, releases = serving.leases, serving.releases
    serving.served("jobs", "k")  # full
    leases.dispatched("jobs", "t1")
    leases.finished("jobs", "t1")
    assert sender.sent == [] and sender.wakes == []  # no round trip of its own, no wake-up
    assert leases.has_room("jobs")  # the worker may fetch again: that fetch carries it
    assert releases.take() == [("jobs", "t1")]
    assert releases.take() == [] and serving.statistics().released == 1
    leases.settled("jobs", "t2")
    fetch.follows = False  # the fetch waits for work: what is held goes now, later ones at once
    serving.flush_releases()
    leases.settled("jobs", "t3")
    assert sender.sent == [("jobs", "t2"), ("jobs", "t3")] and sender.wakes == [False, False]
    assert serving.statistics().released == 3


def test_a_worker_fetches_one_task_ahead_only_while_tasks_are_short() -> None:
    serving = _limited(_Sender())  # one pool slot
    leases = serving.leases
    serving.served("jobs", "k")
    assert leases.capacity("jobs") == 1 and not leases.has_room("jobs")  # nothing measured
    leases.dispatched("jobs", "t1")
    leases.finished("jobs", "t1", runtime=LOOKAHEAD_BELOW / 10)
    assert leases.capacity("jobs") == 2  # short tasks: one more than the pool
    serving.served("jobs", "k")
    serving.served("jobs", "k")
    assert not leases.has_room("jobs")  # one running, one waiting with its lease
    for i in range(30):  # the tasks grow long: the average passes the bound
        leases.dispatched("jobs", f"long-{i}")
        leases.finished("jobs", f"long-{i}", runtime=LOOKAHEAD_BELOW * 10)
        serving.served("jobs", "k")
    assert leases.capacity("jobs") == 1


def test_a_failed_release_is_counted_and_never_raises() -> None:
    sender, fetch = _Sender(), _Fetch()
    serving = _limited(sender, fetch)
    sender.broken = True
    serving.leases.settled("jobs", "t9")
    assert serving.statistics().release_errors == 1
    assert fetch.wakes == 0  # the worker was not full
    serving.served("jobs", "k")
    serving.leases.settled("jobs", "t10")
    assert serving.statistics().release_errors == 2
    assert fetch.wakes == 1  # full: the fetch is woken without the failed pipeline


def test_releases_lost_with_the_connection_are_sent_again_at_the_next_one() -> None:
    sender, fetch = _Sender(), _Fetch(follows=True)
    serving = _limited(sender, fetch)
    leases = serving.leases
    leases.finished("jobs", "carried")  # rides on the next fetch
    assert serving.releases.take() == [("jobs", "carried")]
    leases.finished("jobs", "waiting")  # the connection breaks before a fetch
    fetch.follows = False
    sender.broken = True
    leases.settled("jobs", "failed")  # sent alone, and failed
    assert serving.statistics().unsent_releases == 1
    serving.reset()  # a new connection: the fetch that carried one never answered
    assert serving.statistics().unsent_releases == 3
    sender.broken = False
    assert serving.releases.attach(sender) == 3  # the next connection's settings are written
    assert sorted(tag for _, tag in sender.sent) == ["carried", "failed", "waiting"]
    assert serving.statistics().unsent_releases == 0 and serving.releases.attach(sender) == 0


def test_tasks_running_at_a_connection_loss_free_their_slots_when_the_pool_forgets_them() -> None:
    # Celery < 5.6.3's prefork pool never reports tasks running at a connection
    # loss: their slots go with the next connection's releases, not at lease expiry.
    sender = _Sender()
    serving = _limited(sender)
    leases = serving.leases
    leases.dispatched("jobs", "running")
    leases.dispatched("jobs", "acked-early")
    leases.settled("jobs", "acked-early")  # early ack: it still runs
    leases.dispatched("jobs", "done")
    leases.finished("jobs", "done")  # released already; its late ack is to come
    sender.sent.clear()
    assert serving.reset(running_unreported=True) == 2
    assert serving.releases.attach(sender) == 2
    assert sorted(tag for _, tag in sender.sent) == ["acked-early", "running"]


def test_tasks_running_at_a_connection_loss_keep_their_slots_when_the_pool_reports_them() -> None:
    sender = _Sender()
    serving = _limited(sender)
    serving.leases.dispatched("jobs", "running")
    assert serving.reset() == 0 and serving.releases.attach(sender) == 0
    serving.leases.finished("jobs", "running")  # the pool reports it on the new channel
    assert sender.sent == [("jobs", "running")]


def test_releases_before_a_sender_is_attached_wait_for_it() -> None:
    # A task finished before the worker's first connection wrote its settings (and
    # attached the sender): its slot is freed when the sender comes, not at lease expiry.
    serving = _limited()
    serving.leases.settled("jobs", "early")
    assert serving.statistics().unsent_releases == 1
    serving.reset()  # the first connection: nothing is lost on the way
    sender = _Sender()
    assert serving.releases.attach(sender) == 1 and sender.sent == [("jobs", "early")]


def test_a_fetch_that_answered_ran_its_releases() -> None:
    sender = _Sender()
    serving = _limited(sender, _Fetch(follows=True))
    serving.leases.finished("jobs", "t1")
    serving.releases.take()
    serving.releases.confirm()  # the fetch's reply came
    serving.reset()
    assert serving.releases.attach(sender) == 0 and sender.sent == []
