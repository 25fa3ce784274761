"""FairConsumerMixin against real brokers: shares, acks and the idle loop.

Each test runs on Kombu's in-memory transport, on a real ``redis-server``
and on a real RabbitMQ (session fixtures from ``tests/conftest.py``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection, Queue
from kombu.message import Message

from celery_fair.kombu import FairConsumerMixin
from tests.harness.brokers import publish_plain

pytestmark = pytest.mark.integration

DEADLINE = 120.0
WEIGHTS = (1, 2, 3, 4)
HANDLED = 2000
# Enough that every queue stays backlogged: the heaviest takes 40% of
# HANDLED plus its window.
PUBLISHED = 1200


@pytest.fixture(
    params=["memory", "redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)],
)
def broker_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return str(request.getfixturevalue("rabbitmq_server").url)


@pytest.fixture
def names(broker_url: str) -> Iterator[list[str]]:
    tag = uuid.uuid4().hex[:8]
    queue_names = [f"fair-mixin-{tag}-{i}" for i in range(len(WEIGHTS))]
    yield queue_names
    with Connection(broker_url) as conn:
        channel = conn.channel()
        for name in queue_names:
            Queue(name)(channel).delete()


def remaining(url: str, names: list[str]) -> dict[str, int]:
    # Not passive: Redis has no key for an empty queue, so a passive declare
    # of one fails; redeclaring with the same arguments changes nothing.
    with Connection(url) as conn:
        channel = conn.channel()
        return {n: Queue(n)(channel).queue_declare().message_count for n in names}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Counting:
    """Handler: counts per queue, stops its consumer after ``stop_after`` messages."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.counts: Counter[str] = Counter()
        self.consumer: FairConsumerMixin | None = None

    def __call__(self, queue: str, body: Any, message: Message) -> None:
        self.counts[queue] += 1
        if self.stop_after is not None and self.counts.total() >= self.stop_after:
            assert self.consumer is not None
            self.consumer.should_stop = True


def start(consumer: FairConsumerMixin) -> threading.Thread:
    thread = threading.Thread(target=consumer.run, name="fair-consumer", daemon=True)
    thread.start()
    return thread


def stop(consumer: FairConsumerMixin, thread: threading.Thread) -> None:
    consumer.should_stop = True
    thread.join(DEADLINE)
    assert not thread.is_alive(), "the consumer did not stop"


def test_backlogged_queues_get_their_weight_shares_and_nothing_is_lost(
    broker_url: str, names: list[str]
) -> None:
    weights = dict(zip(names, WEIGHTS, strict=True))
    publish_plain(broker_url, dict.fromkeys(names, PUBLISHED))
    handler = Counting(stop_after=HANDLED)
    consumer = FairConsumerMixin(Connection(broker_url), weights, handler=handler)
    handler.consumer = consumer
    thread = start(consumer)
    try:
        wait_for(lambda: not thread.is_alive(), f"{HANDLED} messages")
    finally:
        stop(consumer, thread)

    counts = handler.counts
    assert counts.total() == HANDLED
    total_weight = sum(WEIGHTS)
    for name, weight in weights.items():
        share = counts[name] / HANDLED
        assert share == pytest.approx(weight / total_weight, abs=0.03), dict(counts)

    # Acked exactly the handled messages; the buffered rest went back.
    expected = {n: PUBLISHED - counts[n] for n in names}
    wait_for(lambda: remaining(broker_url, names) == expected, f"queues at {expected}")
    assert sum(expected.values()) + counts.total() == len(names) * PUBLISHED
    stats = consumer.statistics()
    assert stats.buffered == 0
    assert {q.name: q.acked for q in stats.queues} == dict(counts)
    assert all(q.failed == 0 for q in stats.queues)


def test_idle_consumer_wakes_on_a_delivery_and_stops_on_request(
    broker_url: str, names: list[str]
) -> None:
    publish_plain(broker_url, dict.fromkeys(names, 0))
    handler = Counting()
    consumer = FairConsumerMixin(
        Connection(broker_url),
        dict(zip(names, WEIGHTS, strict=True)),
        handler=handler,
        stop_check_interval=0.2,
    )
    thread = start(consumer)
    try:
        wait_for(lambda: consumer.statistics().idle_waits >= 2, "two idle waits")
        assert handler.counts.total() == 0
        publish_plain(broker_url, {names[0]: 1, names[3]: 2})
        wait_for(lambda: handler.counts.total() == 3, "three deliveries")
        assert handler.counts == Counter({names[0]: 1, names[3]: 2})
    finally:
        stop(consumer, thread)
    wait_for(lambda: sum(remaining(broker_url, names).values()) == 0, "empty queues")


def test_handler_errors_reject_or_requeue_without_losing_messages(
    broker_url: str, names: list[str]
) -> None:
    failing, requeueing = names[:2]
    publish_plain(broker_url, {failing: 10, requeueing: 10})
    seen: Counter[tuple[str, int]] = Counter()
    done = threading.Event()

    def handler(queue: str, body: Any, message: Message) -> None:
        seen[queue, body["i"]] += 1
        if body["i"] == 3 and seen[queue, 3] == 1:
            raise RuntimeError("first attempt fails")
        if sum(seen.values()) >= 20 + 1:
            done.set()

    rejecting = FairConsumerMixin(Connection(broker_url), {failing: 1}, handler=handler)
    thread = start(rejecting)
    try:
        wait_for(lambda: sum(n for (q, _), n in seen.items() if q == failing) == 10, "10")
    finally:
        stop(rejecting, thread)
    requeue = FairConsumerMixin(
        Connection(broker_url), {requeueing: 1}, handler=handler, on_error="requeue"
    )
    thread = start(requeue)
    try:
        wait_for(done.is_set, "all messages, the failed one twice")
    finally:
        stop(requeue, thread)
    # Rejected: message 3 of the first queue is gone after one attempt.
    assert seen[failing, 3] == 1 and rejecting.statistics().queue(failing).failed == 1
    # Requeued: message 3 of the second queue came back and was handled.
    assert seen[requeueing, 3] == 2 and requeue.statistics().queue(requeueing).acked == 10
    wait_for(lambda: sum(remaining(broker_url, names).values()) == 0, "empty queues")


def test_ack_batch_acknowledges_many_per_frame_on_amqp_and_loses_nothing(
    broker_url: str,
    names: list[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    acks: Counter[bool] = Counter()  # basic.ack frames, by their multiple flag
    original = Message.ack

    def counting_ack(self: Message, multiple: bool = False) -> None:
        acks[multiple] += 1
        original(self, multiple=multiple)

    monkeypatch.setattr(Message, "ack", counting_ack)
    per_queue = 37  # not a multiple of any batch: a partial batch is left at the end
    total = per_queue * len(names)
    publish_plain(broker_url, dict.fromkeys(names, per_queue))
    seen: Counter[tuple[str, int]] = Counter()
    consumer = FairConsumerMixin(
        Connection(broker_url),
        dict(zip(names, WEIGHTS, strict=True)),
        handler=lambda queue, body, message: seen.update([(queue, body["i"])]),
        ack_batch=8,
        stop_check_interval=0.2,
    )
    thread = start(consumer)
    try:
        wait_for(lambda: seen.total() == total, f"{total} messages")
        waits = consumer.statistics().idle_waits
        wait_for(lambda: consumer.statistics().idle_waits > waits, "an idle wait")
        if broker_url.startswith("amqp"):
            # Waiting for deliveries, the consumer holds no unacknowledged message:
            # the partial batches went before the wait.
            rabbit = request.getfixturevalue("rabbitmq_server")
            listed = rabbit.ctl("rabbitmqctl", "list_queues", "name", "messages_unacknowledged")
            unacked = dict(line.split("\t") for line in listed.stdout.splitlines() if "\t" in line)
            assert {n: unacked.get(n) for n in names} == dict.fromkeys(names, "0")
    finally:
        stop(consumer, thread)
    assert set(seen.values()) == {1} and seen.total() == total, "each message handled once"
    wait_for(lambda: sum(remaining(broker_url, names).values()) == 0, "empty queues")
    if broker_url.startswith("amqp"):
        assert acks[False] == 0 and 0 < acks[True] <= total // 3, dict(acks)
    else:  # Kombu's virtual transports ignore multiple: one ack per message
        assert acks == Counter({False: total}), dict(acks)


# -- CoDel ---------------------------------------------------------------------


class Ledger:
    """Handler: records (consumer, message number, CoDel returns) of each run.

    ``seconds`` is real work (a slow consumer); the ledger is what proves
    that nothing was lost or handled twice.
    """

    def __init__(self, who: str, seconds: float, ledger: list[tuple[str, int, int]]) -> None:
        self.who = who
        self.seconds = seconds
        self.ledger = ledger

    def __call__(self, queue: str, body: Any, message: Message) -> None:
        if self.seconds:
            time.sleep(self.seconds)
        returns = int((message.headers or {}).get("fair_codel_requeues", 0))
        self.ledger.append((self.who, body["i"], returns))


def handled_once(ledger: list[tuple[str, int, int]], n: int) -> bool:
    return len({i for _, i, _ in ledger}) >= n


def test_codel_returns_a_slow_consumers_stale_messages_to_another_consumer(
    broker_url: str, names: list[str]
) -> None:
    n = 60
    publish_plain(broker_url, {names[0]: n})
    ledger: list[tuple[str, int, int]] = []
    slow = FairConsumerMixin(
        Connection(broker_url), {names[0]: 1}, handler=Ledger("slow", 0.05, ledger),
        window=20, codel_target=0.05, codel_interval=0.3, stop_check_interval=0.2,
    )  # fmt: skip
    slow_thread = start(slow)
    try:
        # The slow consumer fills its window before the other one arrives: a
        # large window makes many stale messages, so that at least one of
        # them reaches the other consumer even when the slow one, freeing a
        # slot, happens to fetch some of its own returns back first.
        wait_for(lambda: slow.statistics().buffered >= 16, "the slow consumer's window")
        fast = FairConsumerMixin(
            Connection(broker_url), {names[0]: 1}, handler=Ledger("fast", 0.0, ledger),
            window=10, stop_check_interval=0.2,
        )  # fmt: skip
        fast_thread = start(fast)
        try:
            wait_for(lambda: handled_once(ledger, n), f"{n} messages handled")
        finally:
            stop(fast, fast_thread)
    finally:
        stop(slow, slow_thread)
    runs = Counter(i for _, i, _ in ledger)
    assert sorted(runs) == list(range(n)) and set(runs.values()) == {1}, "each handled once"
    record = slow.statistics().queue(names[0])
    assert record.codel_requeued > 0, "the slow consumer sent stale messages back"
    # Every return is accounted for by the count its message came back with.
    assert sum(r for _, _, r in ledger) == record.codel_requeued
    returned_to_fast = [i for who, i, r in ledger if who == "fast" and r > 0]
    assert returned_to_fast, "the other consumer handled returned messages"
    wait_for(lambda: remaining(broker_url, names[:1]) == {names[0]: 0}, "an empty queue")


def test_codel_requeue_cap_is_honoured(broker_url: str, names: list[str]) -> None:
    # Alone, a slow consumer gets its returned messages back; after one return
    # a stale message is handled here.
    n = 40
    publish_plain(broker_url, {names[0]: n})
    ledger: list[tuple[str, int, int]] = []
    consumer = FairConsumerMixin(
        Connection(broker_url), {names[0]: 1}, handler=Ledger("one", 0.02, ledger),
        window=10, codel_target=0.02, codel_interval=0.1, codel_max_requeues=1,
        stop_check_interval=0.2,
    )  # fmt: skip
    thread = start(consumer)
    try:
        wait_for(lambda: handled_once(ledger, n), f"{n} messages handled")
    finally:
        stop(consumer, thread)
    runs = Counter(i for _, i, _ in ledger)
    assert sorted(runs) == list(range(n)) and set(runs.values()) == {1}, "each handled once"
    record = consumer.statistics().queue(names[0])
    assert record.codel_requeued > 0
    assert max(r for _, _, r in ledger) == 1, "never returned more than once"
    assert sum(r for _, _, r in ledger) == record.codel_requeued
    wait_for(lambda: remaining(broker_url, names[:1]) == {names[0]: 0}, "an empty queue")


@pytest.mark.rabbitmq
def test_codel_reject_dead_letters_on_rabbitmq(rabbitmq_server: object) -> None:
    url = str(rabbitmq_server.url)  # type: ignore[attr-defined]
    n = 40
    tag = uuid.uuid4().hex[:8]
    names = [f"fair-codel-{tag}", f"fair-codel-{tag}-dead"]
    dead = names[1]
    # Dead-lettered through the default exchange, which routes by queue name.
    queue = Queue(
        names[0],
        queue_arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead},
    )
    with Connection(url) as conn:
        channel = conn.channel()
        Queue(dead)(channel).declare()
        queue(channel).declare()
        producer = conn.Producer(serializer="json")
        for i in range(n):
            producer.publish({"i": i}, routing_key=names[0], declare=[])
    ledger: list[tuple[str, int, int]] = []
    consumer = FairConsumerMixin(
        Connection(url), {queue: 1}, handler=Ledger("one", 0.02, ledger),
        window=10, codel_target=0.02, codel_interval=0.1, codel_action="reject",
        stop_check_interval=0.2,
    )  # fmt: skip
    thread = start(consumer)
    try:
        wait_for(
            lambda: len(ledger) + remaining(url, [dead])[dead] >= n,
            "every message handled or dead-lettered",
        )
    finally:
        stop(consumer, thread)
    record = consumer.statistics().queue(names[0])
    dead_count = remaining(url, [dead])[dead]
    assert dead_count > 0 and dead_count == record.codel_rejected
    handled = [i for _, i, _ in ledger]
    assert len(set(handled)) == len(handled) == n - dead_count, "each handled once or dead"
    with Connection(url) as conn:
        channel = conn.channel()
        messages = [Queue(dead)(channel).get(no_ack=True) for _ in range(dead_count)]
    assert sorted(handled + [m.payload["i"] for m in messages]) == list(range(n))
    with Connection(url) as conn:
        channel = conn.channel()
        for name in names:
            Queue(name)(channel).delete()
