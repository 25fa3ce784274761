"""The one send-back path (``requeue``) and the one admission loop (``next_admitted``).

Nothing is lost: a message a check sends back is copied to the broker before
its original is acknowledged, and one that cannot be sent back stays here,
unacknowledged, to be served (or tried again), with the failure logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

import celery_fair.kombu.requeue as requeue_module
from celery_fair.kombu.requeue import requeue
from celery_fair.scheduling.cost import CostModel
from celery_fair.scheduling.dispatch import DispatchRound, SendBack, next_admitted
from celery_fair.scheduling.shedding import CoDelOptions
from celery_fair.worker.dispatch import admission
from celery_fair.worker.pauses import PausedKeys
from celery_fair.worker.shedder import Shedder

LOG = logging.getLogger("tests.send_back")


class Broker:
    """Stands in for :func:`return_copy`: records each copy, fails when told."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.fail: set[str] = set()

    def __call__(
        self, message: Any, queue: str | None, headers: Mapping[str, Any], *, front: bool
    ) -> None:
        if message.name in self.fail:
            self.fail.discard(message.name)
            raise ConnectionError("broker away")
        self.events.append(("copy", message.name, queue, dict(headers), front))


class FakeMessage:
    def __init__(self, name: str, events: list[Any]) -> None:
        self.name = name
        self.events = events
        self.acknowledged = False

    def ack(self) -> None:
        self.events.append(("ack", self.name))
        self.acknowledged = True

    def reject(self, requeue: bool) -> None:
        self.events.append(("reject", self.name, requeue))
        self.acknowledged = True


class FakeRequest:
    """What the worker's send-back reads of a Celery request."""

    def __init__(self, name: str, events: list[Any], key: str = "t1") -> None:
        self.id = name
        self.key = key
        self.message = FakeMessage(name, events)
        self.acknowledged = False

    def acknowledge(self) -> None:
        self.message.ack()
        self.acknowledged = True

    def reject(self, requeue: bool) -> None:
        self.message.reject(requeue)
        self.acknowledged = True


@pytest.fixture
def events() -> list[Any]:
    return []


@pytest.fixture
def broker(events: list[Any], monkeypatch: pytest.MonkeyPatch) -> Broker:
    fake = Broker(events)
    monkeypatch.setattr(requeue_module, "return_copy", fake)
    return fake


# -- requeue ---------------------------------------------------------------------


def test_requeue_copies_first_then_acknowledges(events: list[Any], broker: Broker) -> None:
    message = FakeMessage("m", events)
    back = SendBack("codel-requeue", "q", {"fair_codel_requeues": 2}, front=True)
    assert requeue(message, back, log=LOG, failure="no")
    assert events == [("copy", "m", "q", {"fair_codel_requeues": 2}, True), ("ack", "m")]


def test_requeue_dead_letters_without_a_copy(events: list[Any], broker: Broker) -> None:
    message = FakeMessage("m", events)
    assert requeue(message, SendBack("codel-reject", "q", dead_letter=True), log=LOG, failure="")
    assert events == [("reject", "m", False)]


def test_a_failed_copy_is_logged_and_the_message_stays(
    events: list[Any], broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    message = FakeMessage("m", events)
    broker.fail.add("m")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        sent = requeue(
            message, SendBack("unknown-task", None, front=False), log=LOG,
            failure="could not send back %r of queue %r", args=("task", "q"),
        )  # fmt: skip
    assert not sent
    assert events == [] and not message.acknowledged  # never acked: not lost
    [record] = caplog.records
    assert record.getMessage() == "could not send back 'task' of queue 'q'"
    assert record.exc_info is not None


def test_requeue_acknowledges_through_the_callers_ack(events: list[Any], broker: Broker) -> None:
    request = FakeRequest("r", events)
    assert requeue(
        request.message, SendBack("paused", "q"), log=LOG, failure="", ack=request.acknowledge
    )
    assert request.acknowledged and events[-1] == ("ack", "r")


# -- the admission loop ------------------------------------------------------------


class SpyRound(DispatchRound[str]):
    def __init__(self) -> None:
        super().__init__(CostModel("count"))
        self.refunded: list[str] = []

    def refund(self, queue: str) -> None:
        self.refunded.append(queue)
        super().refund(queue)


def filled(*items: tuple[str, str]) -> SpyRound:
    round_ = SpyRound()
    round_.set_quanta({"a": 1.0, "b": 1.0})
    for queue, item in items:
        round_.put(queue, item)
    return round_


def test_the_first_send_back_wins_and_is_refunded() -> None:
    round_ = filled(("a", "a0"), ("a", "a1"), ("b", "b0"))
    seen: list[tuple[str, str, int]] = []

    def first(queue: str, item: str, backlog: int) -> SendBack | None:
        seen.append(("first", item, backlog))
        return SendBack("paused", queue) if item == "a0" else None

    def second(queue: str, item: str, backlog: int) -> SendBack | None:
        seen.append(("second", item, backlog))
        return None

    sent: list[tuple[str, str, str]] = []

    def send_back(queue: str, item: str, back: SendBack) -> bool:
        sent.append((queue, item, back.reason))
        return True

    held: list[str | None] = []
    taken = next_admitted(round_, threading.Lock(), [first, second], send_back, hold=held.append)
    assert taken == ("a", "a1")  # a0 went back uncharged: a keeps its turn
    # The second check never saw the message the first sent back.
    assert seen == [("first", "a0", 2), ("first", "a1", 1), ("second", "a1", 1)]
    assert sent == [("a", "a0", "paused")] and round_.refunded == ["a"]
    assert held == ["a0", None, "a1"]


def test_a_failed_send_back_serves_the_message_here() -> None:
    round_ = filled(("a", "a0"))
    taken = next_admitted(
        round_, threading.Lock(), [lambda q, i, n: SendBack("codel-requeue", q)],
        lambda q, i, back: False,
    )  # fmt: skip
    assert taken == ("a", "a0") and round_.refunded == []


def test_an_empty_round_is_reported() -> None:
    empties: list[bool] = []
    taken = next_admitted(
        filled(), threading.Lock(), [], lambda *a: True, empty=lambda: empties.append(True)
    )
    assert taken is None and empties == [True]


# -- the worker's checks: pause, then CoDel ------------------------------------------


class StubShedder:
    """CoDel's place in the worker's loop: sends back what it is told to."""

    def __init__(self, stale: set[str]) -> None:
        self.stale = stale
        self.checked: list[str] = []
        self.sent: list[str] = []
        self.emptied = 0

    def check(self, request: FakeRequest, backlog: int) -> SendBack | None:
        self.checked.append(request.id)
        return SendBack("codel-requeue", "jobs") if request.id in self.stale else None

    def send_back(self, request: FakeRequest, back: SendBack) -> bool:
        self.sent.append(request.id)
        return True

    def empty(self) -> None:
        self.emptied += 1


def stub_service(shedder: StubShedder | None) -> Any:
    dispatch: DispatchRound[FakeRequest] = DispatchRound(CostModel("count"))
    dispatch.set_quanta({"jobs": 1.0})
    return SimpleNamespace(
        scheduler=SimpleNamespace(dispatch=dispatch),
        lock=threading.RLock(),
        pauses=PausedKeys(),
        shedder=shedder,
        queue_map=SimpleNamespace(key_of=lambda request, queue: (request.key, 0, None)),
    )


def test_a_paused_key_goes_back_whole_before_codel_looks(events: list[Any], broker: Broker) -> None:
    shedder = StubShedder(stale={"u0"})
    service = stub_service(shedder)
    requests = [FakeRequest(f"p{i}", events) for i in range(3)]
    requests += [FakeRequest("u0", events, key="t2"), FakeRequest("u1", events, key="t2")]
    for request in requests:
        service.scheduler.dispatch.put("jobs", request, request.key)
    service.pauses.change("jobs", ["t1"], paused=True)
    admit = admission(service, lambda entry: entry)
    taken = admit()
    assert taken is not None and taken[1].id == "u1"
    # The paused key's three went back newest first (the oldest ends first in
    # line), each copied before it was acknowledged; CoDel saw none of them.
    copies = [e[1] for e in events if e[0] == "copy"]
    assert copies == ["p2", "p1", "p0"]
    for name in copies:
        assert events.index(("copy", name, "jobs", {}, True)) < events.index(("ack", name))
    assert service.pauses.returned == 3
    assert shedder.checked == ["u0", "u1"] and shedder.sent == ["u0"]
    assert admit() is None and shedder.emptied == 1


def test_a_paused_task_that_cannot_go_back_waits_again(events: list[Any], broker: Broker) -> None:
    service = stub_service(None)
    requests = [FakeRequest(f"p{i}", events) for i in range(2)]
    for request in requests:
        service.scheduler.dispatch.put("jobs", request, request.key)
    service.pauses.change("jobs", ["t1"], paused=True)
    broker.fail.add("p0")  # once: the next attempt goes through
    assert admission(service, lambda entry: entry)() is None
    # p0 stayed in the buffer (unacknowledged) and went back at the next try.
    assert [e[1] for e in events if e[0] == "copy"] == ["p1", "p0"]
    assert all(r.acknowledged for r in requests) and service.pauses.returned == 2


# -- the worker's CoDel send-back ----------------------------------------------------


def test_the_shedder_counts_a_failed_return_and_runs_the_task(
    events: list[Any], broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    returned: list[tuple[str, str]] = []
    shedder = Shedder(
        CoDelOptions(0.1, 1.0), clock=lambda: 0.0,
        on_returned=lambda request, reason: returned.append((request.id, reason)),
    )  # fmt: skip
    shedder.requeued_by_queue["jobs"] = 2  # as two requeue verdicts count them
    back = SendBack("codel-requeue", "jobs", {"fair_codel_requeues": 1})
    assert shedder.send_back(FakeRequest("ok", events), back)
    assert returned == [("ok", "codel-requeue")]
    broker.fail.add("bad")
    request = FakeRequest("bad", events)
    with caplog.at_level(logging.WARNING, logger="celery_fair.worker.shedder"):
        assert not shedder.send_back(request, back)
    assert not request.acknowledged and returned == [("ok", "codel-requeue")]
    assert "could not return bad to the broker" in caplog.text
    stats = shedder.statistics()
    assert stats.requeued_by_queue == {"jobs": 1} and stats.errors == 1
