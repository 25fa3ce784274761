"""Fairness keys: settings, the worker's per-key buffer order, run-time charges (no broker)."""

from __future__ import annotations

from collections import Counter

import pytest

from celery_fair.errors import FairConfigError, FairConfigWarning
from celery_fair.keys.counters import COUNTED_KEYS
from celery_fair.keys.layout import KeyedNames, level_rank
from celery_fair.keys.publish import _arguments, parse_fair_keys
from celery_fair.keys.serving import KeyedServing, level_weights
from celery_fair.routing.keys import ArgKey, HeaderKey, KwargKey, key_of
from celery_fair.scheduling.buffer import FairBuffer
from celery_fair.wire.served import Served
from celery_fair.worker.settings import FairSettings


def test_fair_keys_take_the_routers_key_specs() -> None:
    parsed = parse_fair_keys({"jobs": "tenant_id", "mail": "header:x-account"})
    assert parsed == {"jobs": KwargKey("tenant_id"), "mail": HeaderKey("x-account")}


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (["jobs"], "fair_keys must map queue names"),
        ({"": "tenant_id"}, "a queue name must be a non-empty string, got ''"),
        ({"jobs": "kwarg:not an identifier"}, "fair_keys['jobs']='kwarg:not an identifier'"),
        ({"jobs": 3.5}, "fair_keys['jobs']=3.5"),
    ],
)
def test_bad_fair_keys_name_the_setting_and_value(value: object, fragment: str) -> None:
    with pytest.raises(FairConfigError) as info:
        parse_fair_keys(value)
    assert fragment in str(info.value)


def test_key_settings_are_validated_at_start() -> None:
    settings = FairSettings.from_conf(
        {"fair_keys": {"jobs": "tenant_id"}, "fair_key_weights": "gold=4,silver=2"}
    )
    assert set(settings.keys) == {"jobs"}
    assert settings.key_weights == {"gold": 4.0, "silver": 2.0}
    assert settings.default_key_weight == 1.0
    with pytest.raises(FairConfigError, match=r"fair_key_weights\['gold'\] must be a positive"):
        FairSettings.from_conf({"fair_key_weights": {"gold": 0}})
    with pytest.raises(FairConfigError, match="fair_default_key_weight must be a positive"):
        FairSettings.from_conf({"fair_default_key_weight": -1})


def test_keys_with_queue_priorities_and_the_priority_settings() -> None:
    keyed = {"fair_keys": {"jobs": "t"}, "task_queue_max_priority": 10}
    assert FairSettings.from_conf(keyed).priority_weights is None  # strict, the default
    weighted = FairSettings.from_conf(
        {**keyed, "fair_priority": "weighted", "fair_priority_weights": "0=8,3=4,6=2,9=1"}
    )
    assert weighted.priority_weights == {0: 8.0, 3: 4.0, 6: 2.0, 9: 1.0}
    assert FairSettings.from_conf({**keyed, "fair_priority": "weighted"}).priority_weights == {}
    with pytest.raises(FairConfigError, match="fair_priority must be one of 'strict', 'weigh"):
        FairSettings.from_conf({**keyed, "fair_priority": "fifo"})
    with pytest.raises(FairConfigError, match="fair_priority_weights=.* needs fair_priority="):
        FairSettings.from_conf({**keyed, "fair_priority_weights": {0: 4}})
    with pytest.raises(FairConfigError, match="a priority must be an integer from 0 to 255"):
        FairSettings.from_conf(
            {**keyed, "fair_priority": "weighted", "fair_priority_weights": {"high": 4}}
        )
    with pytest.raises(FairConfigError, match=r"fair_priority_weights\['0'\] must be a posit"):
        FairSettings.from_conf(
            {**keyed, "fair_priority": "weighted", "fair_priority_weights": {0: 0}}
        )


def test_level_weights_follow_kombus_priority_steps() -> None:
    steps = [0, 3, 6, 9]
    assert KeyedServing(["jobs"]).terms.level_weights(steps) is None
    assert KeyedServing(["jobs"], priority_weights={}).terms.level_weights(steps) == [8, 4, 2, 1]
    given = KeyedServing(["jobs"], priority_weights={0: 4, 5: 2})
    # 5 falls in the level of step 3; the levels given nothing weigh 1.
    assert given.terms.level_weights(steps) == [4.0, 2.0, 1.0, 1.0]
    # RabbitMQ serves the highest priority first: with none given, step 9 weighs most.
    assert level_weights({}, steps, highest_first=True) == [1, 2, 4, 8]
    assert level_weights({9: 4, 0: 1}, steps, highest_first=True) == [1.0, 1.0, 1.0, 4.0]


def test_keys_are_refused_without_the_atomic_fetch() -> None:
    with pytest.raises(FairConfigError, match="needs fair_atomic_fetch=True"):
        FairSettings.from_conf({"fair_keys": {"jobs": "t"}, "fair_atomic_fetch": False})


def test_task_arguments_of_both_protocols() -> None:
    assert _arguments(((1, 2), {"tenant_id": "a"}, {})) == ((1, 2), {"tenant_id": "a"})
    assert _arguments({"args": [1], "kwargs": {"t": 2}}) == ([1], {"t": 2})
    assert _arguments(None) == ((), {})


def test_a_keyword_key_passed_by_position_is_found_through_the_signature() -> None:
    from celery import Celery, Task

    app = Celery("keys_unit", set_as_current=False)

    @app.task(name="plain", shared=False)
    def plain(tenant_id: str, n: int = 0, *, region: str = "eu") -> None: ...

    @app.task(name="bound", bind=True, shared=False)
    def bound(self: Task, n: int, tenant_id: str = "free") -> None: ...

    class Job(Task):  # type: ignore[misc]
        name = "job"

        def run(self, n: int, tenant_id: str | None = None) -> None: ...

    job = app.register_task(Job())
    key = KwargKey("tenant_id")
    assert key_of(key, "plain", ("acme", 1), {}, {}, plain) == "acme"
    assert key_of(key, "plain", (), {"tenant_id": "kw"}, {}, plain) == "kw"
    assert key_of(key, "bound", (1, "acme"), {}, {}, bound) == "acme"  # self is not passed
    assert key_of(key, "bound", (1,), {}, {}, bound) == "free"  # the default the task sees
    assert key_of(key, "job", (1, "acme"), {}, {}, job) == "acme"
    assert key_of(key, "job", (1,), {}, {}, job) is None
    assert key_of(KwargKey("region"), "plain", ("a",), {}, {}, plain) == "eu"  # keyword-only
    assert key_of(KwargKey("nope"), "plain", ("a",), {}, {}, plain) is None
    assert key_of(key, "plain", ("acme",), {"tenant_id": None}, {}, plain) is None  # passed None
    assert key_of(key, "plain", ("acme",), {}, {}, None) is None  # no task: no signature
    assert key_of(ArgKey(1), "plain", ("a", "b"), {}, {}, plain) == "b"


def test_names_never_collide_with_kombus_priority_lists() -> None:
    names = KeyedNames("jobs")
    assert names.key_list("3") == "jobs\x06\x16fair.k.3"  # Kombu's priority 3 is jobs\x06\x163
    assert len({names.active, names.last, names.state, names.weights_conf,
                names.weights_live, names.key_list("a")}) == 6  # fmt: skip


def test_the_buffer_takes_a_keyed_queues_first_level_first_then_keys_in_turn() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    for i in range(4):
        buffer.put("jobs", f"batch-a{i}", "a", 9)
        buffer.put("jobs", f"batch-b{i}", "b", 9)
    buffer.put("jobs", "urgent-c", "c", 0)  # prefetched behind eight batch tasks
    buffer.put("jobs", "urgent-a", "a", 0)
    taken = [item for _, item in (buffer.take(lambda q: 1.0) for _ in range(10))]  # type: ignore[misc]
    assert sorted(taken[:2]) == ["urgent-a", "urgent-c"]
    assert taken[2:6] == ["batch-a0", "batch-b0", "batch-a1", "batch-b1"]


def test_level_ranks_are_kombus_priority_steps() -> None:
    assert [level_rank(s) for s in ("", "\x06\x163", "\x06\x1610", "sep9")] == [0, 3, 10, 9]


def test_the_buffer_serves_a_keyed_queues_keys_in_turn() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    for i in range(8):
        buffer.put("jobs", f"flood-{i}", "flood")
    buffer.put("jobs", "quiet-0", "quiet")  # arrives behind eight flood tasks
    order = [buffer.take(lambda q: 1.0) for _ in range(9)]
    names = [item for _, item in order if item]  # type: ignore[misc]
    assert names.index("quiet-0") <= 1
    # Within a key, publish order is kept.
    flood = [n for n in names if n.startswith("flood")]
    assert flood == [f"flood-{i}" for i in range(8)]
    assert len(buffer) == 0


def test_the_buffer_shares_evenly_between_backlogged_keys() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    for i in range(300):
        buffer.put("jobs", f"a{i}", "a")
    for i in range(100):
        buffer.put("jobs", f"b{i}", "b")
    taken = [buffer.take(lambda q: 1.0) for _ in range(200)]
    counts = Counter(item[1][0] for item in taken if item)
    assert counts == {"a": 100, "b": 100}


def test_the_buffer_keeps_no_key_state_once_empty() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    for i in range(1000):
        buffer.put("jobs", f"x{i}", f"key-{i}")
    while buffer.take(lambda q: 1.0):
        pass
    order = buffer._items["jobs"]
    assert len(order) == 0 and not order._next  # type: ignore[union-attr]


def test_the_buffer_removes_a_keyed_task() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    for item, key in (("a1", "a"), ("b1", "b"), ("a2", "a")):
        buffer.put("jobs", item, key)
    assert buffer.remove("jobs", "b1")
    assert not buffer.remove("jobs", "b1")
    assert [buffer.take(lambda q: 1.0) for _ in range(2)] == [("jobs", "a1"), ("jobs", "a2")]


def test_runtime_corrections_wait_for_the_next_fetch() -> None:
    serving = KeyedServing(["jobs"], runtime=True, estimate=lambda q: 0.005)
    assert serving.terms.charge_at_fetch("jobs") == 0.005
    serving.finished("jobs", Served("gold", 0.005), 0.020)
    serving.finished("jobs", Served("gold", 0.005), 0.001)
    serving.finished("other", Served("x", 1.0), 3.0)  # not a keyed queue: ignored
    serving.finished("jobs", Served("x", None), 1.0)  # no readable charge: ignored
    serving.finished("jobs", Served("gold", 0.005, level="\x06\x169"), 0.005)  # a later level
    serving.finished("jobs", Served("t", 0.005, user="alice"), 0.010)  # a user of t
    charges = serving.counters.take_charges()
    assert charges == [
        ("jobs", "", "gold", "", pytest.approx(0.015)),
        ("jobs", "", "gold", "", pytest.approx(-0.004)),
        ("jobs", "\x06\x169", "gold", "", pytest.approx(0.0)),
        ("jobs", "", "t", "alice", pytest.approx(0.005)),
    ]
    assert serving.counters.take_charges() == []


def test_count_mode_charges_one_and_corrects_nothing() -> None:
    serving = KeyedServing(["jobs"], runtime=False)
    assert serving.terms.charge_at_fetch("jobs") == 1.0
    serving.finished("jobs", Served("a", 1.0), 5.0)
    assert serving.counters.take_charges() == []


def test_served_counts_stay_bounded_and_keep_the_heavy_keys() -> None:
    serving = KeyedServing(["jobs"])
    for i in range(20 * COUNTED_KEYS):
        serving.served("jobs", "heavy" if i % 3 == 0 else f"key-{i}")
    stats = serving.statistics(top=3)
    assert stats.top[0][:2] == ("jobs", "heavy")
    assert stats.served == {"jobs": 20 * COUNTED_KEYS}
    assert len(serving.counters._counts) <= COUNTED_KEYS


def test_counters_count_the_unkeyed_apart_and_keep_charges_only_by_run_time() -> None:
    from celery_fair.keys.counters import KeyCounters
    from celery_fair.keys.layout import UNKEYED

    counters = KeyCounters()
    for key in ("a", UNKEYED, "a"):
        counters.served("jobs", key)
    reading = counters.reading(top=1)
    assert reading.served == {"jobs": 3} and reading.unkeyed == {"jobs": 1}
    assert reading.top == (("jobs", "a", 2),)
    counters.finished("jobs", Served("a", 1.0), 2.0)  # count mode: nothing to correct
    assert counters.reading().pending_charges == 0 and counters.take_charges() == []
    by_runtime = KeyCounters(runtime=True)
    by_runtime.finished("jobs", Served("a", 1.0), 2.0)
    assert by_runtime.reading().pending_charges == 1
    assert by_runtime.take_charges() == [("jobs", "", "a", "", 1.0)]


def test_the_fetch_word_carries_the_lease_with_limits() -> None:
    from celery_fair.keys.limits import KeyLimits
    from celery_fair.keys.serving import FetchTerms

    plain = FetchTerms(limits=KeyLimits())
    assert plain.fetch_word("jobs") == (1.0, "1.0")
    limited = FetchTerms(
        limits=KeyLimits(concurrency={"*": 2}, lease_ttl=60.0),
        runtime=True,
        estimate=lambda queue: 0.25,
    )
    assert limited.fetch_word("jobs") == (0.25, "L0.25:60.0")


def test_plain_consumers_of_a_keyed_queue_are_named() -> None:
    from celery_fair.keys.consumers import plain_consumers

    active = {
        "fair@h": [{"name": "jobs"}, {"name": "other"}],
        "plain@h": [{"name": "jobs"}],
        "elsewhere@h": [{"name": "other"}],
        "silent@h": [{"name": "jobs"}],
    }
    stats = {
        "fair@h": {"cost": "count", "weights": {}},
        "plain@h": {"error": "No such method: fair_stats"},
        "elsewhere@h": {"error": "No such method: fair_stats"},
    }
    assert plain_consumers(active, stats, {"jobs"}) == {"plain@h": ["jobs"], "silent@h": ["jobs"]}


def test_key_limits_are_parsed_and_named_in_errors() -> None:
    from celery_fair.keys.limits import parse_concurrency, parse_rates

    assert parse_concurrency({"*": 2, "gold": "8"}) == {"*": 2, "gold": 8}
    assert parse_concurrency("*=2, gold=8") == {"*": 2, "gold": 8}
    assert parse_rates({"*": "50/s", "free": "6/m", "n": 2}) == {
        "*": 50.0, "free": pytest.approx(0.1), "n": 2.0,
    }  # fmt: skip
    for bad in ({"*": 0}, {"*": 1.5}, {"*": True}, {"*": "x"}):
        with pytest.raises(FairConfigError, match=r"fair_key_concurrency\['\*'\] must be"):
            parse_concurrency(bad)
    for bad in ({"*": "0/s"}, {"*": "fast"}, {"*": -1}):
        with pytest.raises(FairConfigError, match=r"fair_key_rate_limit\['\*'\] must be a rate"):
            parse_rates(bad)


def test_limits_need_keyed_queues_and_default_to_the_visibility_timeout() -> None:
    with pytest.raises(FairConfigError, match="set fair_keys too"):
        FairSettings.from_conf({"fair_key_concurrency": {"*": 2}})
    settings = FairSettings.from_conf(
        {
            "fair_keys": {"jobs": "t"},
            "fair_key_concurrency": {"*": 2},
            "broker_transport_options": {"visibility_timeout": 120},
        }
    )
    assert settings.key_limits.lease_ttl == 120.0
    assert settings.key_limits.as_fields() == {"c:*": "2"}
    with pytest.raises(FairConfigError, match="fair_key_lease_ttl must be a positive"):
        FairSettings.from_conf(
            {"fair_keys": {"jobs": "t"}, "fair_key_rate_limit": "*=1/s", "fair_key_lease_ttl": 0}
        )


class _FakeKeys:
    """Records what the remote-control commands ask of the service's keyed part."""

    def __init__(self) -> None:
        self.limits: list[dict[str, str | None]] = []
        self.weights: list[dict[str, float | None]] = []

    def set_limits(self, fields: dict[str, str | None]) -> None:
        self.limits.append(fields)

    def set_weights(self, weights: dict[str, float | None]) -> None:
        self.weights.append(weights)


class _FakeService:
    """A worker's service as the remote-control commands see it: its keyed part."""

    def __init__(self) -> None:
        self.keys = _FakeKeys()

    def set_key_weights(self, weights: dict[str, float | None]) -> str:
        self.keys.set_weights(weights)
        return "on the broker"

    def set_key_limits(self, fields: dict[str, str | None]) -> None:
        self.keys.set_limits(fields)


def _state(service: _FakeService) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(consumer=SimpleNamespace(controller=SimpleNamespace(fair=service)))


def test_control_fair_key_limits_parses_kinds_and_defaults() -> None:
    from celery_fair.worker.control import fair_key_limits

    service = _FakeService()
    reply = fair_key_limits(_state(service), limits=["concurrency", "gold=8", "*=2", "x=default"])
    # The reply in the user's words, not the broker's field names.
    assert reply == {
        "ok": "concurrency limits set: gold=8, *=2; back to the configured limit: x"
    }, reply
    assert service.keys.limits == [{"c:gold": "8", "c:*": "2", "c:x": None}]
    reply = fair_key_limits(_state(service), limits=["rate", "free=5/s"])
    assert reply == {"ok": "rate limits set: free=5/s"}, reply
    assert service.keys.limits[-1] == {"r:free": "5.0"}
    for bad, fragment in (
        (["speed", "a=1"], "start with 'concurrency' or 'rate'"),
        (["concurrency", "a=0"], "fair_key_limits concurrency['a'] must be an integer"),
        (["rate", "a=fast"], "fair_key_limits rate['a'] must be a rate"),
        (["rate", "a"], "expected KEY=LIMIT"),
        (["rate"], "no KEY=LIMIT given"),
    ):
        reply = fair_key_limits(_state(service), limits=bad)
        assert fragment in reply.get("error", ""), (bad, reply)
    assert len(service.keys.limits) == 2  # invalid input changed nothing


def test_control_fair_key_weights_sets_and_resets() -> None:
    from celery_fair.worker.control import fair_key_weights

    service = _FakeService()
    reply = fair_key_weights(_state(service), weights=["gold=4", "silver=default"])
    assert reply == {"ok": "key weights set {'gold': 4.0, 'silver': None} on the broker"}, reply
    assert service.keys.weights == [{"gold": 4.0, "silver": None}]
    reply = fair_key_weights(_state(service), weights=["gold=-1"])
    assert "fair_key_weights['gold'] must be a positive number" in reply["error"]


def test_lane_key_weights_live_over_configured_over_default() -> None:
    from celery_fair.worker.live_weights import LaneKeyWeights

    weights = LaneKeyWeights({"gold": 4.0}, 1.5)
    assert (weights.weight("gold"), weights.weight("other")) == (4.0, 1.5)
    weights.set({"gold": 8, "other": 2})
    assert (weights.weight("gold"), weights.weight("other")) == (8.0, 2.0)
    weights.set({"gold": None})
    assert weights.weight("gold") == 4.0
    assert weights.live() == {"other": 2.0}
    # From the control log, per keyed queue: over this worker's own and the configured.
    weights.replace_live({"jobs": {"gold": 16.0}, "mail": {}})
    assert (weights.weight("gold", "jobs"), weights.weight("gold", "mail")) == (16.0, 4.0)
    assert weights.weight("other", "jobs") == 2.0
    assert weights.live() == {"gold": 16.0, "other": 2.0}
    weights.replace_live({})
    assert weights.weight("gold", "jobs") == 4.0


def test_a_bad_fair_keys_spec_is_one_clear_error_at_the_first_send() -> None:
    from celery import Celery

    import celery_fair

    app = Celery("bad_keys_unit", broker="memory://", set_as_current=False)
    app.conf.fair_keys = {"jobs": "args:0"}
    celery_fair.install(app)  # the app module still imports

    @app.task(name="job", shared=False)
    def job(x: int) -> None: ...

    with pytest.raises(FairConfigError, match=r"fair_keys\['jobs'\]='args:0'"):
        job.apply_async((1,), queue="jobs")


def test_a_bad_durable_counts_setting_is_one_clear_error_at_the_first_send() -> None:
    from celery import Celery

    import celery_fair

    app = Celery("bad_durable_unit", broker="memory://", set_as_current=False)
    app.conf.fair_keys = {"jobs": "kwarg:tenant_id"}
    app.conf.fair_key_max_backlog = {"*": 10}
    app.conf.fair_key_max_backlog_durable = "sometimes"
    said = "fair_key_max_backlog_durable.*every task this app sends raises it"
    with pytest.warns(FairConfigWarning, match=said):
        celery_fair.install(app)

    @app.task(name="job", shared=False)
    def job(tenant_id: str) -> None: ...

    with pytest.raises(FairConfigError, match="fair_key_max_backlog_durable.*'sometimes'"):
        job.apply_async(kwargs={"tenant_id": "a"}, queue="jobs")


def test_a_marker_is_persistent_when_its_task_outlives_a_broker_restart() -> None:
    """Celery's rule for the delivery mode: the one given, else the queue's exchange's,
    else ``task_default_delivery_mode``; a quorum queue or a stream keeps every
    message; a queue that is not durable keeps none."""
    from celery import Celery
    from kombu.entity import Exchange, Queue

    from celery_fair.keys.publish import _persistent

    app = Celery("persistent_unit", broker="memory://", set_as_current=False)
    lane = Queue("jobs.fair.s0", Exchange(""), routing_key="jobs.fair.s0")
    assert _persistent(app, {"queue": lane})  # Celery's default: persistent
    assert not _persistent(app, {"queue": lane, "delivery_mode": 1})
    assert not _persistent(app, {"queue": lane, "delivery_mode": "transient"})
    transient = Queue("t", Exchange("t", delivery_mode=1), routing_key="t")
    assert not _persistent(app, {"queue": transient})
    assert _persistent(app, {"queue": transient, "delivery_mode": 2})
    assert not _persistent(app, {"queue": Queue("x", durable=False)})
    quorum = Queue("q", queue_arguments={"x-queue-type": "quorum"})
    assert _persistent(app, {"queue": quorum, "delivery_mode": 1})
    app.conf.task_default_delivery_mode = "transient"
    assert not _persistent(app, {"queue": lane})


def test_an_unset_durable_counts_setting_is_its_default() -> None:
    from celery_fair.keys.publish import producer_settings

    assert producer_settings({"fair_key_max_backlog_durable": None})[2] is False
    assert producer_settings({"fair_key_max_backlog_durable": "yes"})[2] is True


def test_install_without_keys_or_admission_leaves_celerys_task_sender_unbuilt() -> None:
    # Building it at import would make an event dispatcher and resolve the
    # broker's transport before the app module has registered it.
    from celery import Celery

    import celery_fair

    app = Celery("no_sender_unit", broker="notregisteredyet://", set_as_current=False)
    celery_fair.install(app)
    celery_fair.install(app)
    assert "send_task_message" not in vars(app.amqp)


def test_registering_again_puts_the_settings_read_last_in_force() -> None:
    # install() reads fair_keys at import; the worker reads it again at start
    # (set after install, or corrected): the hook is replaced, not kept.
    from celery import Celery

    import celery_fair
    from celery_fair.keys.publish import register_app

    app = Celery("keys_again_unit", broker="memory://", set_as_current=False)
    sent: list[str] = []
    app.amqp.send_task_message = lambda producer, name, message, *a, **k: sent.append(name)
    app.conf.fair_keys = {"jobs": "args:0"}
    celery_fair.install(app)
    with pytest.raises(FairConfigError, match=r"fair_keys\['jobs'\]='args:0'"):
        app.send_task("job", (1,), queue="jobs")
    app.conf.fair_keys = {}
    register_app(app)
    app.send_task("job", (1,), queue="jobs")
    assert sent == ["job"]
    app.conf.fair_keys = {"jobs": "nope:0"}
    register_app(app)
    register_app(app)
    with pytest.raises(FairConfigError, match=r"fair_keys\['jobs'\]='nope:0'"):
        app.send_task("job", (2,), queue="jobs")
    hooks, wrapped = [], app.amqp.send_task_message
    while wrapped is not None:
        hooks.append(getattr(wrapped, "name", None))
        wrapped = getattr(wrapped, "__wrapped__", None)
    assert hooks == ["keys", None]  # one hook of keys (none of admission), over the sender


def test_the_buffer_gives_turns_to_users_of_a_two_level_key_and_hands_back_a_keys_tasks() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    buffer.set_quanta({"jobs": 1.0})
    for i in range(4):
        buffer.put("jobs", f"flood{i}", "t1", user="flood")
    buffer.put("jobs", "quiet", "t1", user="quiet")
    buffer.put("jobs", "other", "t2", user="u")
    taken = [buffer.take(lambda q: 1.0) for _ in range(3)]
    # Turns go to the keys first, then to the users within a key's turns: the
    # quiet user's task is not behind the flooding user's four, and t2 is not
    # behind t1's users.
    assert [item for _, item in taken if item] == ["flood0", "other", "quiet"]
    # A paused key's tasks, oldest first, out of the buffer; the others stay.
    assert buffer.take_key("jobs", "t1") == ["flood1", "flood2", "flood3"]
    assert len(buffer) == 0 and buffer.take_key("jobs", "t1") == []
    buffer.put("jobs", "after", "t3")
    assert buffer.take(lambda q: 1.0) == ("jobs", "after")


def test_two_level_turns_go_to_keys_by_weight_then_to_their_users_by_weight() -> None:
    """Hierarchical, as the Redis fetch: t1's three users share t1's turns; t1 and
    t2 get 1:1 whatever their number of users; a user of weight 3 gets 3 to 1."""
    buffer: FairBuffer[str] = FairBuffer()
    buffer.set_quanta({"jobs": 1.0})
    for i in range(60):
        for user in ("a", "b", "c"):
            buffer.put("jobs", f"t1:{user}:{i}", "t1", user=user)
        buffer.put("jobs", f"t2:x:{i}", "t2", user="x")
        buffer.put("jobs", f"t3:u:{i}", "t3", user="u", cost=1.0, user_cost=1.0)
        buffer.put("jobs", f"t3:v:{i}", "t3", user="v", cost=1.0, user_cost=1 / 3)
    taken = [buffer.take(lambda q: 1.0)[1] for _ in range(120)]  # type: ignore[index]
    by_key = {key: sum(item.startswith(key) for item in taken) for key in ("t1", "t2", "t3")}
    assert by_key == {"t1": 40, "t2": 40, "t3": 40}
    t1_users = {u: sum(item.startswith(f"t1:{u}:") for item in taken) for u in "abc"}
    assert max(t1_users.values()) - min(t1_users.values()) <= 1
    t3 = [item for item in taken if item.startswith("t3")]
    assert sum(item.startswith("t3:v") for item in t3) == 30  # 3:1 within t3's 40
    # Within one user, publish order.
    assert [item for item in taken if item.startswith("t1:a:")] == [
        f"t1:a:{i}" for i in range(t1_users["a"])
    ]


def test_two_level_buffer_keeps_levels_removals_and_listing_consistent() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    buffer.set_quanta({"jobs": 1.0})
    buffer.put("jobs", "batch", "t1", level=3, user="a")
    buffer.put("jobs", "urgent", "t1", level=0, user="b")
    buffer.put("jobs", "plain", "t2", level=0)
    buffer.put("jobs", "gone", "t1", level=3, user="a")
    assert sorted(buffer) == ["batch", "gone", "plain", "urgent"]
    assert buffer.remove("jobs", "gone") and len(buffer) == 3
    assert not buffer.remove("jobs", "gone")
    taken = [buffer.take(lambda q: 1.0)[1] for _ in range(3)]  # type: ignore[index]
    # Level first: both urgent tasks before t1's batch task, whose turn is level 3.
    assert taken[2] == "batch" and set(taken[:2]) == {"urgent", "plain"}
    assert buffer.take(lambda q: 1.0) is None and len(buffer) == 0


def test_weighted_levels_share_the_buffer_by_weight_and_bank_no_credit() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    buffer.set_quanta({"jobs": 1.0})
    buffer.set_level_weights("jobs", {-9: 4.0, 0: 1.0})
    for i in range(40):
        for key in ("a", "b"):
            buffer.put("jobs", f"urgent-{key}{i}", key, -9)
            buffer.put("jobs", f"batch-{key}{i}", key, 0)
    taken = [buffer.take(lambda q: 1.0)[1] for _ in range(50)]  # type: ignore[index]
    # 4:1 in every stretch of five, and the keys take turns within each level.
    for start in range(0, 50, 5):
        assert sum(t.startswith("urgent") for t in taken[start : start + 5]) == 4, taken
    urgent = [t for t in taken if t.startswith("urgent")]
    assert urgent[:4] == ["urgent-a0", "urgent-b0", "urgent-a1", "urgent-b1"]
    # The batch level alone for a while banks nothing: urgent work comes back at 4:1.
    drained: FairBuffer[str] = FairBuffer()
    drained.set_quanta({"jobs": 1.0})
    drained.set_level_weights("jobs", {-9: 4.0, 0: 1.0})
    for i in range(20):
        drained.put("jobs", f"batch-{i}", "a", 0)
    for _ in range(10):
        drained.take(lambda q: 1.0)
    for i in range(8):
        drained.put("jobs", f"urgent-{i}", "b", -9)
    again = [drained.take(lambda q: 1.0)[1] for _ in range(10)]  # type: ignore[index]
    assert sum(t.startswith("urgent") for t in again) == 8, again
    # Four (and the tie at the fifth) before a batch task, not the ten it missed.
    assert [t.startswith("urgent") for t in again[:7]].index(False) <= 5, again


def test_weighted_levels_serve_a_two_level_keys_turn_from_its_own_level() -> None:
    buffer: FairBuffer[str] = FairBuffer()
    buffer.set_quanta({"jobs": 1.0})
    buffer.set_level_weights("jobs", {-9: 1.0, 0: 1.0})
    for i in range(4):
        buffer.put("jobs", f"urgent-{i}", "t1", level=-9, user="a")
        buffer.put("jobs", f"batch-{i}", "t1", level=0, user="b")
    taken = [buffer.take(lambda q: 1.0)[1] for _ in range(8)]  # type: ignore[index]
    # Equal weights alternate the levels; a turn of the batch level serves the batch user.
    assert taken == [t for i in range(4) for t in (f"urgent-{i}", f"batch-{i}")], taken
    assert buffer.take(lambda q: 1.0) is None


def test_keyed_checks_follow_what_the_channel_serves() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from celery_fair.worker.build import KEYED_RECHECK, keyed_checks
    from celery_fair.worker.pauses import PAUSED_RECHECK
    from celery_fair.worker.service import FairService
    from celery_fair.worker.settings import FairSettings

    plain = FairService(FairSettings(weights={"a": 1}))
    assert keyed_checks(plain) == []
    keyed = FairService(FairSettings(keys={"jobs": "tenant_id"}))
    assert keyed_checks(keyed) == [(PAUSED_RECHECK, keyed.refresh_paused)]
    # With the atomic fetch on the channel, keyed backlogs are looked for too.
    plain.attachment.cycle = cast(Any, SimpleNamespace(atomic=object()))
    assert keyed_checks(plain) == [(KEYED_RECHECK, plain.keys.recheck_backlogs)]


def test_a_keys_limit_is_live_then_configured_then_the_live_and_configured_default() -> None:
    from celery_fair.keys.limits import KeyLimits, resolve
    from celery_fair.keys.tokens import token_specs

    configured = {"gold": 8.0, "*": 2.0}
    assert resolve(configured, {}, "gold") == 8.0
    assert resolve(configured, {"gold": 1.0}, "gold") == 1.0
    assert resolve(configured, {"*": 5.0}, "gold") == 8.0  # its own entry wins over "*"
    assert resolve(configured, {"*": 5.0}, "free") == 5.0
    assert resolve(configured, {}, "free") == 2.0
    assert resolve({}, {}, "free") is None
    limits = KeyLimits(concurrency={"*": 1})
    (own,) = token_specs(limits, "jobs", "a")
    (live,) = token_specs(limits, "jobs", "a", {"c": {"a": 3.0}})
    # A changed limit is another set of tokens: the name carries the count.
    assert (own.count, live.count) == (1, 3) and own.name != live.name
    assert token_specs(KeyLimits(), "jobs", "a") == ()
    (rate,) = token_specs(KeyLimits(), "jobs", "a", {"r": {"*": 5.0}})
    assert (rate.kind, rate.count, rate.period) == ("r", 5, 1.0)
