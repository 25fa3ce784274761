"""FairConsumerMixin on Kombu's in-memory transport: shares, acks, errors, options."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from kombu import Connection, Queue
from kombu.message import Message

import celery_fair.kombu
from celery_fair.kombu import FairConsumerMixin
from celery_fair.kombu.mixin import split_window
from tests.harness.brokers import publish_plain
from tests.harness.clock import FakeClock

URL = "memory://"
DEADLINE = 60.0


@pytest.fixture
def names() -> list[str]:
    # The memory transport's queues are process-global: fresh names per test.
    tag = uuid.uuid4().hex[:8]
    return [f"fair-{tag}-{i}" for i in range(4)]


def publish(counts: Mapping[str, int], url: str = URL) -> None:
    publish_plain(url, counts)


def remaining(names: list[str], url: str = URL) -> dict[str, int]:
    with Connection(url) as conn:
        channel = conn.channel()
        return {n: Queue(n)(channel).queue_declare(passive=True).message_count for n in names}


class Recorder:
    """A handler that counts per queue and stops the consumer after ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.calls: list[tuple[str, Any]] = []
        self.consumer: FairConsumerMixin | None = None

    def __call__(self, queue: str, body: Any, message: Message) -> None:
        self.calls.append((queue, body))
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            assert self.consumer is not None
            self.consumer.should_stop = True

    @property
    def counts(self) -> Counter[str]:
        return Counter(queue for queue, _ in self.calls)


def make(queues: Mapping[str, float], handler: Recorder, **options: Any) -> FairConsumerMixin:
    options.setdefault("stop_check_interval", 0.05)
    consumer = FairConsumerMixin(Connection(URL), queues, handler=handler, **options)
    handler.consumer = consumer
    return consumer


@pytest.fixture
def in_thread() -> Iterator[Callable[[FairConsumerMixin], threading.Thread]]:
    started: list[tuple[FairConsumerMixin, threading.Thread]] = []

    def start(consumer: FairConsumerMixin) -> threading.Thread:
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        started.append((consumer, thread))
        return thread

    yield start
    for consumer, thread in started:
        consumer.should_stop = True
        thread.join(DEADLINE)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- shares and acknowledgements ---------------------------------------------


def test_backlogged_queues_are_served_in_proportion_to_their_weights(names: list[str]) -> None:
    weights = dict(zip(names, (1, 2, 3, 4), strict=True))
    publish(dict.fromkeys(names, 1000))
    recorder = Recorder(stop_after=2000)
    consumer = make(weights, recorder)
    consumer.run()
    counts = recorder.counts
    for name, weight in weights.items():
        assert counts[name] / 2000 == pytest.approx(weight / 10, abs=0.03), counts
    # DWRR with integer quantum ratios is exact up to one round.
    assert counts == Counter(dict(zip(names, (200, 400, 600, 800), strict=True)))


def test_handled_messages_are_acked_and_the_rest_requeued_on_stop(names: list[str]) -> None:
    publish(dict.fromkeys(names, 300))
    recorder = Recorder(stop_after=500)
    consumer = make(dict(zip(names, (1, 2, 3, 4), strict=True)), recorder)
    consumer.run()
    left = remaining(names)
    # The queues lost exactly the handled messages: buffered ones went back.
    assert {n: 300 - left[n] for n in names} == {n: recorder.counts[n] for n in names}
    assert sum(left.values()) + len(recorder.calls) == 4 * 300
    stats = consumer.statistics()
    assert stats.buffered == 0
    assert sum(q.acked for q in stats.queues) == 500


def test_messages_of_one_queue_are_handled_in_order(names: list[str]) -> None:
    publish({names[0]: 50, names[1]: 50})
    recorder = Recorder(stop_after=100)
    make({names[0]: 1, names[1]: 3}, recorder).run()
    for name in names[:2]:
        assert [b["i"] for q, b in recorder.calls if q == name] == list(range(50))


def test_a_queue_alone_takes_all_the_capacity(names: list[str]) -> None:
    # Work conserving: the idle heavy queue's share goes to the light one.
    publish({names[0]: 100})
    recorder = Recorder(stop_after=100)
    make({names[0]: 1, names[1]: 9}, recorder).run()
    assert recorder.counts == Counter({names[0]: 100})


def test_no_queue_buffers_more_than_its_window(names: list[str]) -> None:
    publish(dict.fromkeys(names, 200))
    seen: list[tuple[int, int]] = []

    class Checking(Recorder):
        def __call__(self, queue: str, body: Any, message: Message) -> None:
            assert self.consumer is not None
            for record in self.consumer.statistics().queues:
                seen.append((record.buffered, record.window))
            super().__call__(queue, body, message)

    recorder = Checking(stop_after=400)
    make(dict(zip(names, (1, 2, 3, 4), strict=True)), recorder, window=20).run()
    assert seen and all(buffered <= window for buffered, window in seen)
    assert max(buffered for buffered, _ in seen) > 0


# -- cost modes ---------------------------------------------------------------


def test_runtime_cost_shares_handler_time_not_message_counts(names: list[str]) -> None:
    slow, fast = names[:2]
    publish({slow: 400, fast: 400})
    clock = FakeClock()
    durations = {slow: 3.0, fast: 1.0}

    class Timed(Recorder):
        def __call__(self, queue: str, body: Any, message: Message) -> None:
            clock.now += durations[queue]
            super().__call__(queue, body, message)

    recorder = Timed(stop_after=400)
    consumer = make({slow: 1, fast: 1}, recorder, cost="runtime", clock=clock, runtime_quantum=1)
    consumer.run()
    counts = recorder.counts
    # Equal weights: equal run time, so three fast messages per slow one.
    assert counts[fast] / counts[slow] == pytest.approx(3.0, rel=0.05)
    stats = consumer.statistics()
    assert stats.queue(slow).served_cost == pytest.approx(3.0 * counts[slow])
    assert stats.queue(fast).served_cost == pytest.approx(1.0 * counts[fast])


def test_count_cost_charges_one_per_message(names: list[str]) -> None:
    publish({names[0]: 10})
    recorder = Recorder(stop_after=10)
    consumer = make({names[0]: 2}, recorder)
    consumer.run()
    assert consumer.statistics().queue(names[0]).served_cost == 10


# -- handler errors -------------------------------------------------------------


def failing_on(first_i: int, times: int = 1) -> Callable[[Recorder, str, Any], None]:
    failures = Counter[int]()

    def check(recorder: Recorder, queue: str, body: Any) -> None:
        if body["i"] == first_i and failures[first_i] < times:
            failures[first_i] += 1
            raise RuntimeError(f"boom on {first_i}")

    return check


class Failing(Recorder):
    def __init__(self, stop_after: int, check: Callable[[Recorder, str, Any], None]) -> None:
        super().__init__(stop_after)
        self.check = check
        self.attempts = 0

    def __call__(self, queue: str, body: Any, message: Message) -> None:
        self.attempts += 1
        if self.stop_after is not None and self.attempts >= self.stop_after:
            assert self.consumer is not None
            self.consumer.should_stop = True
        self.check(self, queue, body)
        self.calls.append((queue, body))


def test_reject_drops_the_failed_message_and_logs_it(
    names: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    publish({names[0]: 5})
    recorder = Failing(5, failing_on(2))
    consumer = make({names[0]: 1}, recorder)
    with caplog.at_level(logging.ERROR, logger="celery_fair.kombu.mixin"):
        consumer.run()
    assert [b["i"] for _, b in recorder.calls] == [0, 1, 3, 4]
    assert remaining(names[:1]) == {names[0]: 0}
    assert consumer.statistics().queue(names[0]).failed == 1
    assert "boom on 2" in caplog.text and "rejected" in caplog.text


def test_requeue_puts_the_failed_message_back(names: list[str]) -> None:
    publish({names[0]: 5})
    recorder = Failing(6, failing_on(2))
    consumer = make({names[0]: 1}, recorder, on_error="requeue")
    consumer.run()
    assert sorted(b["i"] for _, b in recorder.calls) == [0, 1, 2, 3, 4]
    assert remaining(names[:1]) == {names[0]: 0}


def test_raise_requeues_and_ends_run(names: list[str]) -> None:
    publish({names[0]: 5})
    recorder = Failing(100, failing_on(2))
    consumer = make({names[0]: 1}, recorder, on_error="raise")
    with pytest.raises(RuntimeError, match="boom on 2"):
        consumer.run()
    # Handled 0 and 1; the failed one and the buffered rest are back.
    assert [b["i"] for _, b in recorder.calls] == [0, 1]
    assert remaining(names[:1]) == {names[0]: 3}


def test_a_handler_may_ack_or_reject_itself(names: list[str]) -> None:
    publish({names[0]: 4})

    class SelfAcking(Recorder):
        def __call__(self, queue: str, body: Any, message: Message) -> None:
            if body["i"] % 2:
                message.reject(requeue=False)
            else:
                message.ack()
            super().__call__(queue, body, message)

    recorder = SelfAcking(stop_after=4)
    consumer = make({names[0]: 1}, recorder)
    consumer.run()
    assert len(recorder.calls) == 4
    assert remaining(names[:1]) == {names[0]: 0}


def test_undecodable_body_is_rejected_without_calling_the_handler(
    names: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with Connection(URL) as conn:
        Queue(names[0])(conn.channel()).declare()
        producer = conn.Producer()
        producer.publish(b"{not json", routing_key=names[0], content_type="application/json")
        producer.publish({"i": 1}, routing_key=names[0], serializer="json")
    recorder = Recorder(stop_after=1)
    consumer = make({names[0]: 1}, recorder)
    with caplog.at_level(logging.ERROR, logger="celery_fair.kombu.mixin"):
        consumer.run()
    assert recorder.calls == [(names[0], {"i": 1})]
    assert remaining(names[:1]) == {names[0]: 0}
    assert "cannot decode" in caplog.text


# -- the idle loop and stopping --------------------------------------------------


def test_idle_consumer_waits_then_wakes_on_a_delivery_and_stops_on_request(
    names: list[str], in_thread: Callable[[FairConsumerMixin], threading.Thread]
) -> None:
    publish({names[0]: 0})
    recorder = Recorder()
    consumer = make({names[0]: 1}, recorder)
    thread = in_thread(consumer)
    wait_for(lambda: consumer.statistics().idle_waits >= 2, "idle waits")
    assert recorder.calls == []
    publish({names[0]: 1})
    wait_for(lambda: len(recorder.calls) == 1, "the delivery")
    consumer.should_stop = True
    thread.join(DEADLINE)
    assert not thread.is_alive()


def test_subclass_overrides_handle(names: list[str]) -> None:
    publish({names[0]: 3})
    handled: list[int] = []

    class Worker(FairConsumerMixin):
        def __init__(self, connection: Connection) -> None:
            super().__init__(connection, {names[0]: 1}, stop_check_interval=0.05)

        def handle(self, queue: str, body: Any, message: Message) -> None:
            handled.append(body["i"])
            if len(handled) == 3:
                self.should_stop = True

    Worker(Connection(URL)).run()
    assert handled == [0, 1, 2]


def test_consume_with_a_limit_handles_that_many(names: list[str]) -> None:
    publish({names[0]: 10})
    recorder = Recorder()
    consumer = make({names[0]: 1}, recorder)
    for _ in consumer.consume(limit=4):
        pass
    assert len(recorder.calls) == 4
    assert remaining(names[:1]) == {names[0]: 6}


# -- options and statistics ----------------------------------------------------------


def test_window_is_split_by_weight_at_least_one_each() -> None:
    assert split_window({"a": 1, "b": 2, "c": 3, "d": 4}, 40) == {
        "a": 4,
        "b": 8,
        "c": 12,
        "d": 16,
    }
    assert split_window({"a": 1, "b": 99}, 10) == {"a": 1, "b": 10}


def test_windows_default_and_override() -> None:
    recorder = Recorder()
    consumer = make({"a": 1, "b": 3}, recorder)
    assert consumer.windows == {"a": 12, "b": 38}
    consumer = make({"a": 1, "b": 3}, recorder, window=8, windows={"a": 3})
    assert consumer.windows == {"a": 3, "b": 6}
    assert consumer.weights == {"a": 1.0, "b": 3.0}


def test_queues_may_be_kombu_queues_or_pairs() -> None:
    recorder = Recorder()
    consumer = make([(Queue("x"), 2), ("y", 1)], recorder)  # type: ignore[arg-type]
    assert consumer.weights == {"x": 2.0, "y": 1.0}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queues": {}}, "queues={}"),
        ({"queues": {"a": 0}}, "queues['a']=0"),
        ({"queues": {"a": "heavy"}}, "queues['a']='heavy'"),
        ({"queues": {"a": True}}, "queues['a']=True"),
        ({"queues": [("a", 1), ("a", 2)]}, "queues='a'"),
        ({"window": 0}, "window=0"),
        ({"window": 2.5}, "window=2.5"),
        ({"windows": {"zz": 2}}, "windows='zz'"),
        ({"windows": {"a": 0}}, "windows['a']=0"),
        ({"cost": "bytes"}, "cost='bytes'"),
        ({"runtime_quantum": -1}, "runtime_quantum=-1"),
        ({"on_error": "ignore"}, "on_error='ignore'"),
        ({"stop_check_interval": 0}, "stop_check_interval=0"),
        ({"ack_batch": 0}, "ack_batch=0"),
        ({"ack_batch": 1.5}, "ack_batch=1.5"),
        ({"clock": 3}, "clock=3"),
        ({"handler": None}, "handler=None"),
        ({"handler": "print"}, "handler='print'"),
        ({"codel_target": 0.1}, "codel_interval=None: must be set with codel_target=0.1"),
        ({"codel_interval": 1}, "codel_target=None: must be set with codel_interval=1"),
        ({"codel_target": 0, "codel_interval": 1}, "codel_target=0"),
        ({"codel_target": 0.1, "codel_interval": -1}, "codel_interval=-1"),
        ({"codel_target": 0.1, "codel_interval": "1s"}, "codel_interval='1s'"),
        ({"codel_target": 2, "codel_interval": 1}, "codel_target=2: must be below codel_interval"),
        ({"codel_target": 1, "codel_interval": 1}, "codel_target=1: must be below codel_interval"),
        ({"codel_action": "drop"}, "codel_action='drop'"),
        ({"codel_max_requeues": -1}, "codel_max_requeues=-1"),
        ({"codel_max_requeues": True}, "codel_max_requeues=True"),
    ],
)
def test_bad_options_fail_at_construction_naming_option_and_value(
    options: dict[str, Any], message: str
) -> None:
    queues = options.pop("queues", {"a": 1})
    options.setdefault("handler", Recorder())
    with pytest.raises(ValueError) as info:
        FairConsumerMixin(Connection(URL), queues, **options)
    assert message in str(info.value)


def test_unknown_options_are_rejected() -> None:
    with pytest.raises(TypeError):
        FairConsumerMixin(Connection(URL), {"a": 1}, handler=Recorder(), prefetch=3)  # type: ignore[call-arg]


def test_statistics_is_a_frozen_record(names: list[str]) -> None:
    publish({names[0]: 6, names[1]: 6})
    recorder = Recorder(stop_after=6)
    consumer = make({names[0]: 1, names[1]: 2}, recorder)
    consumer.run()
    stats = consumer.statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.handled = 0  # type: ignore[misc]
    assert stats.handled == 6 and stats.cost == "count"
    record = stats.queue(names[1])
    assert (record.weight, record.window) == (2.0, 33)
    assert record.served_count == record.acked == recorder.counts[names[1]]
    as_dict = stats.as_dict()
    assert set(as_dict["queues"]) == set(names[:2])  # type: ignore[call-overload]
    assert "deficit" in as_dict["queues"][names[0]]  # type: ignore[index]


# -- CoDel ---------------------------------------------------------------------------


class Slow(Recorder):
    """A handler whose every message takes ``seconds`` of the fake clock.

    Records the body and the CoDel return count of every handled message;
    stops the consumer once ``distinct`` different messages were handled.
    """

    def __init__(self, clock: FakeClock, seconds: float, distinct: int) -> None:
        super().__init__()
        self.clock = clock
        self.seconds = seconds
        self.distinct = distinct
        self.returns: list[int] = []

    def __call__(self, queue: str, body: Any, message: Message) -> None:
        self.clock.now += self.seconds
        self.returns.append(int((message.headers or {}).get("fair_codel_requeues", 0)))
        super().__call__(queue, body, message)
        assert self.consumer is not None
        if len({b["i"] for _, b in self.calls}) >= self.distinct:
            self.consumer.should_stop = True


def test_codel_is_off_unless_set(names: list[str]) -> None:
    publish({names[0]: 30})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=30)
    consumer = make({names[0]: 1}, recorder, window=10, clock=recorder.clock)
    consumer.run()
    assert [b["i"] for _, b in recorder.calls] == list(range(30))
    assert set(recorder.returns) == {0}
    assert consumer.statistics().codel is None


def test_fresh_messages_are_never_returned(names: list[str]) -> None:
    # Ten buffered messages of 10 ms wait at most 0.1 s: below the target.
    publish({names[0]: 50})
    recorder = Slow(FakeClock(), seconds=0.01, distinct=50)
    consumer = make(
        {names[0]: 1}, recorder, window=10, clock=recorder.clock,
        codel_target=0.2, codel_interval=1.0,
    )  # fmt: skip
    consumer.run()
    assert [b["i"] for _, b in recorder.calls] == list(range(50))
    stats = consumer.statistics()
    assert stats.codel is not None and stats.codel.drops == 0 and stats.codel.decisions == 50
    assert stats.queue(names[0]).codel_requeued == 0


def test_stale_messages_go_back_with_a_count_and_the_cap_holds(names: list[str]) -> None:
    # One consumer, ten buffered messages of 1 s each: a standing queue.
    n = 40
    publish({names[0]: n})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=n)
    consumer = make(
        {names[0]: 1}, recorder, window=10, clock=recorder.clock,
        codel_target=0.5, codel_interval=2.0, codel_max_requeues=2,
    )  # fmt: skip
    consumer.run()
    record = consumer.statistics().queue(names[0])
    # Each message handled exactly once: a return replaces it, never copies it.
    assert sorted(b["i"] for _, b in recorder.calls) == list(range(n))
    assert record.codel_requeued > 0
    # The ledger: every return shows up in the count the message came back with.
    assert sum(recorder.returns) == record.codel_requeued
    # The cap: a message returned twice is handled here when stale again.
    assert max(recorder.returns) == 2 and record.codel_kept > 0
    assert remaining(names[:1]) == {names[0]: 0}
    codel = consumer.statistics().codel
    assert codel is not None and codel.drops == record.codel_requeued + record.codel_kept


def test_a_message_codel_cannot_send_back_is_handled_here(
    names: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The broker refuses every copy: each stale message is handled here, once,
    # and every failure is logged and counted (nothing is lost).
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker away")

    monkeypatch.setattr("celery_fair.kombu.requeue.return_copy", refuse)
    n = 30
    publish({names[0]: n})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=n)
    consumer = make(
        {names[0]: 1}, recorder, window=10, clock=recorder.clock,
        codel_target=0.5, codel_interval=2.0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="celery_fair.kombu.mixin"):
        consumer.run()
    assert sorted(b["i"] for _, b in recorder.calls) == list(range(n))
    assert set(recorder.returns) == {0}
    failures = caplog.text.count("CoDel could not return a message of queue")
    assert failures > 0
    assert consumer.statistics().queue(names[0]).codel_requeued == 0
    assert consumer._codel is not None and consumer._codel.errors == failures
    assert remaining(names[:1]) == {names[0]: 0}


def test_the_first_drop_waits_for_a_whole_interval_above_target(names: list[str]) -> None:
    # RFC 8289: nothing leaves before the sojourn stayed above target for an
    # interval, however stale the messages look.
    publish({names[0]: 12})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=12)
    consumer = make(
        {names[0]: 1}, recorder, window=12, clock=recorder.clock,
        codel_target=0.5, codel_interval=100.0,
    )  # fmt: skip
    consumer.run()
    assert [b["i"] for _, b in recorder.calls] == list(range(12))
    assert consumer.statistics().queue(names[0]).codel_requeued == 0


def test_reject_action_rejects_stale_messages_without_requeue(
    names: list[str], in_thread: Callable[[FairConsumerMixin], threading.Thread]
) -> None:
    # The memory transport has no dead-lettering: rejected messages are gone.
    n = 40
    publish({names[0]: n})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=n + 1)  # stopped below
    consumer = make(
        {names[0]: 1}, recorder, window=10, clock=recorder.clock,
        codel_target=0.5, codel_interval=2.0, codel_action="reject",
    )  # fmt: skip
    thread = in_thread(consumer)

    def accounted() -> bool:
        return len(recorder.calls) + consumer.statistics().queue(names[0]).codel_rejected >= n

    wait_for(accounted, "every message handled or rejected")
    consumer.should_stop = True
    thread.join(DEADLINE)
    record = consumer.statistics().queue(names[0])
    handled = sorted(b["i"] for _, b in recorder.calls)
    assert record.codel_rejected > 0 and record.codel_requeued == 0
    assert len(set(handled)) == len(handled) == n - record.codel_rejected
    assert set(recorder.returns) == {0}
    assert remaining(names[:1]) == {names[0]: 0}


def test_codel_statistics_are_reported(names: list[str]) -> None:
    publish({names[0]: 20})
    recorder = Slow(FakeClock(), seconds=1.0, distinct=20)
    consumer = make(
        {names[0]: 1}, recorder, window=10, clock=recorder.clock,
        codel_target=0.5, codel_interval=2.0,
    )  # fmt: skip
    consumer.run()
    as_dict = consumer.statistics().as_dict()
    codel = as_dict["codel"]
    assert isinstance(codel, dict) and codel["target"] == 0.5 and codel["interval"] == 2.0
    queue = as_dict["queues"][names[0]]  # type: ignore[index]
    assert queue["codel_requeued"] == codel["drops"] - queue["codel_kept"]


def test_package_exports() -> None:
    assert "FairConsumerMixin" in celery_fair.kombu.__all__
    for name in celery_fair.kombu.__all__:
        assert hasattr(celery_fair.kombu, name)
