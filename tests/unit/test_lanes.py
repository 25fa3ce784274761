"""Keyed queues on RabbitMQ: lane names and the lane each task takes (pure, injected clock)."""

from __future__ import annotations

from collections import Counter

from kombu import Queue

from celery_fair.keys.lanes import (
    LEVEL_STEPS,
    NOISY_LANES,
    SHARD_LANES,
    KeyLanes,
    LaneChooser,
    first_level,
    lane_queue,
    level_lane,
    level_step,
)
from celery_fair.routing.isolation import NOISY_MESSAGES
from tests.harness.clock import FakeClock


def test_every_keyed_queue_has_the_same_fixed_lanes() -> None:
    lanes = KeyLanes(frozenset(["jobs", "mail"]))
    assert lanes.lanes("jobs") == (
        *(f"jobs.fair.s{i}" for i in range(SHARD_LANES)),
        *(f"jobs.fair.n{i}" for i in range(NOISY_LANES)),
    )
    parents = lanes.parents()
    assert parents["jobs"] == "jobs" and parents["mail.fair.s2"] == "mail"
    assert len(parents) == 2 * (1 + SHARD_LANES + NOISY_LANES)


def test_keys_hash_to_shards_always_the_same_and_spread_out() -> None:
    chooser = LaneChooser(KeyLanes(frozenset(["jobs"])), clock=FakeClock())
    shards = set(KeyLanes(frozenset(["jobs"])).shard_lanes("jobs"))
    # Many keys, each rarely: every one on a shard, always the same one, spread out.
    first = {f"t{i}": chooser.lane("jobs", f"t{i}") for i in range(400)}
    assert set(first.values()) <= shards
    assert all(chooser.lane("jobs", k) == lane for k, lane in first.items())
    per_shard = Counter(first.values())
    assert len(per_shard) == SHARD_LANES and max(per_shard.values()) < 3 * 400 / SHARD_LANES


def test_a_flood_moves_to_a_noisy_lane_after_its_first_messages() -> None:
    clock = FakeClock()
    chooser = LaneChooser(KeyLanes(frozenset(["jobs"])), clock=clock)
    lanes = [chooser.lane("jobs", "flood") for _ in range(200)]
    noisy = set(KeyLanes(frozenset(["jobs"])).noisy_lanes("jobs"))
    first = next(i for i, lane in enumerate(lanes) if lane in noisy)
    assert first == NOISY_MESSAGES - 1  # the 30th publish is the first isolated
    assert len(set(lanes[:first])) == 1 and set(lanes[:first]) <= set(
        KeyLanes(frozenset(["jobs"])).shard_lanes("jobs")
    )
    assert len(set(lanes[first:])) == 1
    # A quiet key meanwhile stays on its shard.
    assert chooser.lane("jobs", "quiet") not in noisy
    # Once the flood has calmed down (decayed, then held), it is back on its shard.
    clock.advance(120)
    for _ in range(50):
        chooser.lane("jobs", "others")
    clock.advance(30)
    assert chooser.lane("jobs", "flood") == lanes[0]


def test_the_choice_says_when_a_key_gets_its_noisy_lane() -> None:
    """The producer names the key of a noisy lane for the exporter once, when given."""
    chooser = LaneChooser(KeyLanes(frozenset(["jobs"])), clock=FakeClock())
    choices = [chooser.choose("jobs", "flood") for _ in range(100)]
    given = [i for i, (_, who) in enumerate(choices) if who is not None]
    assert given == [NOISY_MESSAGES - 1] and choices[given[0]][1] == "flood"
    lane = choices[given[0]][0]
    assert KeyLanes.directory(lane) == lane + ".key"


def test_a_flooding_user_gets_a_lane_apart_from_its_keys_other_users() -> None:
    """Two-level keys: the user that floods is isolated by itself, so its key's
    other users wait neither behind it nor in the shard the key hashes to."""
    lanes = KeyLanes(frozenset(["jobs"]))
    chooser = LaneChooser(lanes, clock=FakeClock())
    shard = chooser.lane("jobs", "t1", "quiet")
    assert shard in lanes.shard_lanes("jobs")
    choices = [chooser.choose("jobs", "t1", "flood") for _ in range(100)]
    given = [(i, who) for i, (_, who) in enumerate(choices) if who is not None]
    # The key is found noisy (its user's publishes count for it, and it had one
    # more), then the user by itself, which has a lane of its own from then on.
    assert given == [(NOISY_MESSAGES - 2, "t1"), (NOISY_MESSAGES - 1, "t1/flood")]
    flood_lane = choices[-1][0]
    assert {lane for lane, _ in choices[NOISY_MESSAGES - 1 :]} == {flood_lane}
    assert flood_lane in lanes.noisy_lanes("jobs")
    # The key's other users go to the key's own noisy lane, not the flood's.
    quiet_lane, who = chooser.choose("jobs", "t1", "quiet")
    assert quiet_lane == choices[NOISY_MESSAGES - 2][0] != flood_lane
    assert who is None
    # Another key's users are untouched.
    assert chooser.lane("jobs", "t2", "flood") in lanes.shard_lanes("jobs")


def test_one_producers_noisy_keys_get_different_noisy_lanes() -> None:
    chooser = LaneChooser(KeyLanes(frozenset(["jobs"])), clock=FakeClock())
    got: dict[str, str] = {}
    keys = [f"f{i}" for i in range(NOISY_LANES)]  # each 1/8 of the publishes: noisy
    for _ in range(100):
        for key in keys:
            got[key] = chooser.lane("jobs", key)
    assert len(set(got.values())) == NOISY_LANES, got
    assert set(got.values()) <= set(KeyLanes(frozenset(["jobs"])).noisy_lanes("jobs"))


def test_each_keyed_queue_counts_its_own_publishes() -> None:
    chooser = LaneChooser(KeyLanes(frozenset(["a", "b"])), clock=FakeClock())
    for _ in range(100):
        chooser.lane("a", "flood")
    # The same key in another queue is not noisy there.
    assert chooser.lane("b", "flood").startswith("b.fair.s")


def test_a_lane_is_declared_as_its_queue_is() -> None:
    parent = Queue("jobs", durable=True, queue_arguments={"x-queue-type": "quorum"})
    lane = lane_queue(parent, "jobs.fair.s3")
    assert lane.name == lane.routing_key == "jobs.fair.s3"
    assert lane.exchange.name == ""  # the default exchange: no binding to declare
    assert lane.durable and lane.queue_arguments == {"x-queue-type": "quorum"}


def test_a_lane_carries_its_queues_delivery_mode() -> None:
    """Celery gives a task without a delivery mode its queue's exchange's: a laned task
    keeps the mode it would have had in the queue itself."""
    from kombu.entity import Exchange

    transient = Queue("jobs", Exchange("jobs", delivery_mode=1), routing_key="jobs")
    assert lane_queue(transient, "jobs.fair.s3").exchange.delivery_mode == 1
    assert lane_queue(Queue("jobs"), "jobs.fair.s3").exchange.delivery_mode is None


def test_a_queue_with_a_maximum_priority_has_lanes_per_level() -> None:
    lanes = KeyLanes(frozenset(["jobs", "mail"]), frozenset(["jobs"]))
    first = KeyLanes(frozenset(["jobs"])).lanes("jobs")
    assert lanes.lanes("mail") == KeyLanes(frozenset(["mail"])).lanes("mail")
    assert len(lanes.lanes("jobs")) == len(first) * len(LEVEL_STEPS)
    assert lanes.lanes("jobs")[: len(first)] == first
    assert "jobs.fair.pri9.s3" in lanes.lanes("jobs") and "jobs.fair.pri3.n7" in lanes.lanes("jobs")
    assert lanes.parents()["jobs.fair.pri6.n0"] == "jobs"
    # A priority falls in the level of the highest step at or below it.
    assert [level_step(p) for p in (None, 0, 2, 3, 5, 6, 9, 10, 255, -1, True, "9")] == [
        0, 0, 0, 3, 3, 6, 9, 9, 9, 0, 0, 0,
    ]  # fmt: skip
    assert level_lane("jobs", "jobs.fair.s3", 7) == "jobs.fair.pri6.s3"
    assert level_lane("jobs", "jobs.fair.n1", 1) == "jobs.fair.n1"
    assert first_level("jobs", "jobs.fair.pri6.s3") == "jobs.fair.s3"
    assert first_level("jobs", "jobs.fair.s3") == "jobs.fair.s3"
    assert first_level("jobs.fair.pri6", "jobs.fair.pri6.fair.s1") == "jobs.fair.pri6.fair.s1"
    assert lanes.is_shard("jobs", "jobs.fair.pri9.s15") and not lanes.is_shard(
        "jobs", "jobs.fair.pri9.n0"
    )
    # Every level's lane is distinct from every other's and from the queue's.
    assert len(set(lanes.lanes("jobs")) | {"jobs"}) == len(lanes.lanes("jobs")) + 1


def test_a_resumed_task_goes_to_its_levels_lane_when_the_levels_were_found_on_the_broker() -> None:
    """``celery fair keys resume`` without the app: the queue is known only by name, and
    the levels the command found on the broker decide where a parked task goes back."""
    from celery_fair.keys.pause_log import PauseLog

    unknown = {"jobs": Queue("jobs", durable=True)}  # as the command has it
    found = PauseLog(lambda: None, unknown, as_found=True, prioritised=("jobs",))
    assert found.destination("jobs", "a", 9).startswith("jobs.fair.pri9.n")
    assert found.destination("jobs", "a", 4).startswith("jobs.fair.pri3.n")
    assert found.destination("jobs", "a", None).startswith("jobs.fair.n")
    none = PauseLog(lambda: None, unknown, as_found=True)
    assert none.destination("jobs", "a", 9).startswith("jobs.fair.n")
