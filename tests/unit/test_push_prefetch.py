"""``fair_prefetch="auto"`` on AMQP: re-consuming with new windows, on a fake channel.

The worker's service is wired to a real ``kombu.Consumer`` whose channel is a
fake AMQP channel that records every method sent; a fake clock advances
only where the test (or the fake broker's round trip) says so.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Consumer, Queue

from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings
from tests.harness.clock import FakeClock

ROUND_TRIP = 0.005  # what a synchronous basic.qos costs on the fake channel


class FakeMessage:
    """What py-amqp hands a consumer callback (the parts Kombu reads)."""

    errors: list[Any] = []

    def __init__(self, delivery_tag: int, consumer_tag: str) -> None:
        self.delivery_tag = delivery_tag
        self.delivery_info = {"consumer_tag": consumer_tag, "delivery_tag": delivery_tag}


class FakeChannel:
    """Records the AMQP methods sent; delivers on request."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[Any, ...]] = []
        self.callbacks: dict[str, Any] = {}
        self.next_delivery_tag = 0

    def basic_qos(self, prefetch_size: int, prefetch_count: int, a_global: bool) -> None:
        self.clock.now += ROUND_TRIP
        self.sent.append(("qos", prefetch_count, a_global))

    def basic_consume(
        self, queue: str = "", consumer_tag: str = "", callback: Any = None, **kwargs: Any
    ) -> str:
        self.sent.append(("consume", queue, consumer_tag))
        self.callbacks[consumer_tag] = callback
        return consumer_tag

    def basic_cancel(self, consumer_tag: str, nowait: bool = False) -> None:
        self.sent.append(("cancel", consumer_tag))
        del self.callbacks[consumer_tag]

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.sent.append(("ack", delivery_tag))

    def basic_reject(self, delivery_tag: int, requeue: bool = True) -> None:
        self.sent.append(("reject", delivery_tag))

    def deliver(self, consumer_tag: str) -> int:
        self.next_delivery_tag += 1
        self.callbacks[consumer_tag](FakeMessage(self.next_delivery_tag, consumer_tag))
        return self.next_delivery_tag

    def methods(self) -> list[tuple[Any, ...]]:
        """The methods sent since the last call, acks left out."""
        sent = [m for m in self.sent if m[0] != "ack"]
        self.sent.clear()
        return sent


class World:
    def __init__(self, weights: dict[str, float], **settings: Any) -> None:
        self.clock = FakeClock(100.0)
        self.channel = FakeChannel(self.clock)
        self.received: list[Any] = []
        self.task_consumer = Consumer(
            self.channel,  # type: ignore[arg-type]
            queues=[Queue(name) for name in weights],
            on_message=self.received.append,
            auto_declare=False,
        )
        settings.setdefault("prefetch", "auto")
        self.service = FairService(
            FairSettings(weights=weights, **settings), concurrency=1, clock=self.clock
        )
        celery_consumer = SimpleNamespace(
            task_consumer=self.task_consumer, initial_prefetch_count=26, qos_global=False, qos=None
        )
        self.service.attach_push(celery_consumer)
        self.task_consumer.consume()

    def tag(self, queue: str) -> str:
        return str(self.task_consumer._active_tags[queue])

    def fill(self, queue: str, n: int) -> list[int]:
        return [self.channel.deliver(self.tag(queue)) for _ in range(n)]


def test_windows_start_from_celerys_prefetch_and_are_consumed_with_per_consumer_qos() -> None:
    world = World({"q": 1})
    assert world.channel.methods() == [("qos", 26, False), ("consume", "q", world.tag("q"))]
    assert world.service.statistics()["prefetch_windows"] == {"q": 26}


def test_a_slower_task_time_shrinks_the_window_by_re_consuming_on_the_same_channel() -> None:
    world = World({"q": 1})
    old_tag = world.tag("q")
    delivered = world.fill("q", 26)
    world.channel.methods()
    world.service.prefetch.observe_service(0.040)
    new_tag = world.tag("q")
    # round trip 5 ms / 40 ms per task: 1 per slot, plus 1 spare.
    assert world.channel.methods() == [
        ("cancel", old_tag),
        ("qos", 2, False),
        ("consume", "q", new_tag),
    ]
    assert new_tag != old_tag
    stats = world.service.statistics()
    assert stats["prefetch_windows"] == {"q": 2}
    assert stats["adaptive_prefetch"]["reconsumes"] == 1  # type: ignore[index]
    # The old consumer's messages are still acked on the channel: nothing lost.
    for tag in delivered:
        world.channel.basic_ack(tag)
    assert [m for m in world.channel.sent if m[0] == "ack"] == [("ack", t) for t in delivered]
    assert world.service.prefetch.push is not None
    assert world.service.prefetch.push.statistics().unacked_by_consumer == {}


def test_an_ack_that_frees_a_full_window_times_the_refill() -> None:
    world = World({"q": 1}, prefetch_max=26)
    delivered = world.fill("q", 25)
    push = world.service.prefetch.push
    assert push is not None and world.service.prefetch.adaptive is not None
    # An ack below a full window tells nothing: the broker did not wait for it.
    world.channel.basic_ack(delivered[0])
    world.clock.now += 0.5
    world.channel.deliver(world.tag("q"))
    world.channel.deliver(world.tag("q"))
    assert push.round_trip_samples == 0
    # Full (26 unacked): this ack frees the slot the next delivery fills.
    world.channel.basic_ack(delivered[1])
    world.clock.now += 0.001
    world.channel.deliver(world.tag("q"))
    assert push.round_trip_samples == 1
    assert world.service.prefetch.adaptive.round_trip == pytest.approx(0.001)


def test_window_changes_are_rate_limited_and_unchanged_windows_are_left_alone() -> None:
    world = World({"q": 1})
    world.service.prefetch.observe_service(0.040)
    world.channel.methods()
    # Same estimate: nothing to do.
    for _ in range(5):
        world.service.prefetch.observe_service(0.040)
    assert world.channel.methods() == []
    # Tasks become much faster than the round trip: the window grows, but
    # not within a second of the last change.
    for _ in range(60):
        world.service.prefetch.observe_service(0.0001)
    assert world.channel.methods() == []
    world.clock.now += 1.0
    world.service.prefetch.observe_service(0.0001)
    sent = world.channel.methods()
    assert [m[0] for m in sent] == ["cancel", "qos", "consume"]
    assert world.service.prefetch.windows["q"] > 2


def test_weights_keep_their_proportions_when_the_windows_shrink() -> None:
    world = World({"a": 1, "b": 3})
    assert world.service.prefetch.windows == {"a": 13, "b": 39}
    world.channel.methods()
    world.service.prefetch.observe_service(0.040)
    assert world.service.prefetch.windows == {"a": 2, "b": 6}
    sent = world.channel.methods()
    assert sorted(m for m in sent if m[0] == "qos") == [("qos", 2, False), ("qos", 6, False)]
    assert len([m for m in sent if m[0] == "cancel"]) == 2


def test_a_resize_decided_on_another_thread_waits_for_the_consumers_next_delivery() -> None:
    world = World({"q": 1})
    world.channel.methods()
    thread = threading.Thread(target=world.service.prefetch.observe_service, args=(0.040,))
    thread.start()
    thread.join()
    # The channel is not thread safe: nothing was sent from the pool thread.
    assert world.channel.methods() == []
    assert world.service.prefetch.windows == {"q": 26}
    world.channel.deliver(world.tag("q"))
    assert [m[0] for m in world.channel.methods()] == ["cancel", "qos", "consume"]
    assert world.service.prefetch.windows == {"q": 2}
    assert len(world.received) == 1  # the delivery itself was handled first


def test_fixed_windows_are_never_re_consumed() -> None:
    world = World({"q": 1}, prefetch=None)
    world.fill("q", 5)
    world.channel.methods()
    world.service.prefetch.observe_service(0.040)
    assert world.channel.methods() == []
    assert world.service.prefetch.push is None


def test_a_reconnection_consumes_with_the_adapted_window_at_once() -> None:
    world = World({"q": 1})
    world.service.prefetch.observe_service(0.040)
    assert world.service.prefetch.windows == {"q": 2}
    # The connection is lost; Celery revives the consumer on a new channel.
    channel = FakeChannel(world.clock)
    task_consumer = Consumer(
        channel,  # type: ignore[arg-type]
        queues=[Queue("q")],
        on_message=world.received.append,
        auto_declare=False,
    )
    world.service.attach_push(
        SimpleNamespace(
            task_consumer=task_consumer, initial_prefetch_count=26, qos_global=False, qos=None
        )
    )
    task_consumer.consume()
    assert channel.methods() == [
        ("qos", 2, False),
        ("consume", "q", task_consumer._active_tags["q"]),
    ]


def test_before_any_estimate_the_windows_are_celerys_even_with_a_larger_maximum() -> None:
    world = World({"q": 1}, prefetch_max=100)
    assert world.channel.methods() == [("qos", 26, False), ("consume", "q", world.tag("q"))]
