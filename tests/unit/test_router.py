"""ConsistentHashRouter: key sources, task filters, missing keys, header stamping, validation."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_fair.routing import (
    ConsistentHashRouter,
    HashRing,
    HeaderKey,
    MissingRouteKeyError,
    RouterStatistics,
)

QUEUES = {"t0": 10, "t1": 10, "t2": 20}


def route(router: ConsistentHashRouter, name: str = "proj.tasks.work", *, args: Any = (),
          kwargs: Any = None, options: Any = None) -> dict[str, Any] | None:  # fmt: skip
    return router(name, args, kwargs or {}, {} if options is None else options)


# -- key sources ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "call"),
    [
        ("tenant_id", {"kwargs": {"tenant_id": "acme"}}),
        ("kwarg:tenant_id", {"kwargs": {"tenant_id": "acme"}}),
        (1, {"args": ("x", "acme")}),
        ("arg:1", {"args": ("x", "acme")}),
        ("header:x-tenant", {"options": {"headers": {"x-tenant": "acme"}}}),
        ("property:message_id", {"options": {"message_id": "acme"}}),
        ("property:correlation_id", {"options": {"correlation_id": "acme"}}),
        (lambda name, args, kwargs, options: kwargs["t"]["id"], {"kwargs": {"t": {"id": "acme"}}}),
        (HeaderKey("x-tenant"), {"options": {"headers": {"x-tenant": "acme"}}}),
    ],
)
def test_every_key_source_routes_by_the_ring(key: Any, call: dict[str, Any]) -> None:
    router = ConsistentHashRouter(QUEUES, key=key)
    assert route(router, **call) == {
        "queue": HashRing(QUEUES).lookup("acme"),
        "headers": {"fair_key": "acme"},
    }


def test_same_key_same_queue_different_keys_spread() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    seen: dict[str, set[str]] = {}
    for i in range(3000):
        tenant = f"tenant-{i % 300}"
        result = route(router, kwargs={"tenant_id": tenant})
        assert result is not None
        seen.setdefault(tenant, set()).add(result["queue"])
    assert all(len(queues) == 1 for queues in seen.values())
    assert Counter(q for (q,) in seen.values()).keys() == set(QUEUES)


@settings(max_examples=100, deadline=None)
@given(st.permutations(sorted(QUEUES)), st.text(min_size=1, max_size=20))
def test_listing_order_never_changes_the_queue(order: list[str], tenant: str) -> None:
    reordered = ConsistentHashRouter({q: QUEUES[q] for q in order}, key="tenant_id")
    reference = ConsistentHashRouter(QUEUES, key="tenant_id")
    assert reordered.queue_for(tenant) == reference.queue_for(tenant)


def test_int_and_uuid_keys_are_stamped_as_text() -> None:
    router = ConsistentHashRouter(["a", "b"], key="tenant_id")
    result = route(router, kwargs={"tenant_id": 42})
    assert result is not None
    assert result["headers"] == {"fair_key": "42"}
    assert result["queue"] == router.queue_for("42")


def test_unhashable_key_type_names_task_and_source() -> None:
    router = ConsistentHashRouter(["a", "b"], key="tenant_id")
    with pytest.raises(TypeError, match=r"'proj.tasks.work'.*'tenant_id'.*float"):
        route(router, kwargs={"tenant_id": 1.5})


# -- tasks filter -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tasks", "name", "applies"),
    [
        (None, "anything", True),
        ("proj.tasks.work", "proj.tasks.work", True),
        ("proj.tasks.work", "proj.tasks.work2", False),
        ("proj.tasks.*", "proj.tasks.work", True),
        ("proj.tasks.*", "proj.other.work", False),
        (["a.x", "proj.*"], "proj.tasks.work", True),
        (re.compile(r"proj\.(tasks|jobs)\."), "proj.jobs.run", True),
        (re.compile(r"proj\.(tasks|jobs)\."), "other.proj.jobs.run", False),
    ],
)
def test_tasks_filter_follows_celery_route_patterns(tasks: Any, name: str, applies: bool) -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id", tasks=tasks)
    result = route(router, name, kwargs={"tenant_id": "acme"})
    assert (result is not None) is applies


def test_filtered_out_task_is_not_checked_for_its_key() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id", tasks="proj.*")
    assert route(router, "celery.chord_unlock") is None


# -- missing keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call", [{}, {"kwargs": {"tenant_id": None}}, {"kwargs": {"tenant_id": ""}}]
)
def test_missing_key_is_an_error_naming_task_and_key(call: dict[str, Any]) -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    with pytest.raises(MissingRouteKeyError, match=r"'proj.tasks.work'.*'tenant_id'"):
        route(router, **call)
    assert router.statistics().missing_errors == 1


def test_missing_header_and_index_are_errors_too() -> None:
    with pytest.raises(MissingRouteKeyError, match="message header 'x-tenant'"):
        route(ConsistentHashRouter(QUEUES, key="header:x-tenant"), options={"headers": {}})
    with pytest.raises(MissingRouteKeyError, match="positional argument 2"):
        route(ConsistentHashRouter(QUEUES, key=2), args=("a", "b"))


def test_spread_sends_unkeyed_tasks_over_all_queues_by_weight() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id", on_missing="spread")
    counts = Counter()
    for _ in range(4000):
        result = route(router)
        assert result is not None and "headers" not in result
        counts[result["queue"]] += 1
    # t2 has half the weight: far from a pile-up, close to its share.
    assert set(counts) == set(QUEUES)
    assert 0.45 < counts["t2"] / 4000 < 0.55
    assert router.statistics().missing_spread == 4000


def test_fallback_queue_receives_unkeyed_tasks() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id", on_missing="unkeyed")
    assert route(router) == {"queue": "unkeyed"}
    assert router.statistics().missing_fallback == 1


# -- headers ----------------------------------------------------------------------------------


def test_caller_headers_are_kept_and_not_mutated() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    caller = {"trace": "abc"}
    options: dict[str, Any] = {"headers": caller}
    result = route(router, kwargs={"tenant_id": "acme"}, options=options)
    assert result is not None
    assert options["headers"] == {"trace": "abc", "fair_key": "acme"}
    assert caller == {"trace": "abc"}


def test_custom_header_name_and_no_stamping() -> None:
    stamped = route(ConsistentHashRouter(QUEUES, key="t", header="x-k"), kwargs={"t": "a"})
    assert stamped is not None and stamped["headers"] == {"x-k": "a"}
    plain = route(ConsistentHashRouter(QUEUES, key="t", header=None), kwargs={"t": "a"})
    assert plain is not None and "headers" not in plain


def test_exchange_mode_leaves_the_choice_to_the_broker() -> None:
    router = ConsistentHashRouter(QUEUES, key="t", exchange="fair.hash")
    assert route(router, kwargs={"t": "acme"}) == {
        "exchange": "fair.hash",
        "exchange_type": "x-consistent-hash",
        "routing_key": "acme",
        "headers": {"fair_key": "acme"},
    }
    with pytest.raises(MissingRouteKeyError):
        route(router)


# -- through a real Celery app ----------------------------------------------------------------


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = []

    def record(sender: str, routing_key: str, headers: dict[str, Any], **_: Any) -> None:
        messages.append({"task": sender, "routing_key": routing_key, "headers": dict(headers)})

    before_task_publish.connect(record, weak=False)
    try:
        yield messages
    finally:
        before_task_publish.disconnect(record)


def make_app(router: ConsistentHashRouter) -> Celery:
    app = Celery("router_unit", broker="memory://", set_as_current=False)
    app.conf.task_routes = (router,)

    @app.task(name="proj.tasks.work", shared=False)
    def work(payload: str, tenant_id: str | None = None) -> str:
        return payload

    return app


def test_celery_publishes_to_the_routed_queue_with_the_key_header(
    published: list[dict[str, Any]],
) -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    app = make_app(router)
    work = app.tasks["proj.tasks.work"]
    for tenant in ("acme", "globex", "initech", "acme"):
        work.apply_async(("p",), {"tenant_id": tenant}, headers={"trace": "t1"})
    assert [m["routing_key"] for m in published] == [
        router.queue_for(t) for t in ("acme", "globex", "initech", "acme")
    ]
    assert [m["headers"]["fair_key"] for m in published] == ["acme", "globex", "initech", "acme"]
    assert all(m["headers"]["trace"] == "t1" for m in published)


def test_celery_caller_queue_still_wins_but_key_is_stamped(
    published: list[dict[str, Any]],
) -> None:
    app = make_app(ConsistentHashRouter(QUEUES, key="tenant_id"))
    app.tasks["proj.tasks.work"].apply_async(("p",), {"tenant_id": "acme"}, queue="manual")
    assert published[0]["routing_key"] == "manual"
    assert published[0]["headers"]["fair_key"] == "acme"


def test_celery_apply_async_raises_on_missing_key(published: list[dict[str, Any]]) -> None:
    app = make_app(ConsistentHashRouter(QUEUES, key="tenant_id"))
    with pytest.raises(MissingRouteKeyError, match="proj.tasks.work"):
        app.tasks["proj.tasks.work"].delay("p")
    assert published == []


def test_celery_routes_a_key_passed_by_position(published: list[dict[str, Any]]) -> None:
    # def work(payload, tenant_id=None): the key is the second positional argument.
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    app = make_app(router)
    for tenant in ("acme", "globex", "initech"):
        app.tasks["proj.tasks.work"].delay("p", tenant)
    assert [m["routing_key"] for m in published] == [
        router.queue_for(t) for t in ("acme", "globex", "initech")
    ]
    assert [m["headers"]["fair_key"] for m in published] == ["acme", "globex", "initech"]


# -- validation and statistics ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"queues": {}}, "queues="),
        ({"queues": []}, "queues="),
        ({"queues": {"a": 0}}, "'a'"),
        ({"queues": {"a": -2}}, "'a'"),
        ({"on_missing": ""}, "on_missing=''"),
        ({"on_missing": None}, "on_missing=None"),
        ({"key": "bogus:x"}, "key='bogus:x'"),
        ({"key": "arg:x"}, "key='arg:x'"),
        ({"key": "property:timestamp"}, "key='property:timestamp'"),
        ({"key": "not an identifier"}, "key='not an identifier'"),
        ({"key": "header:"}, "key='header:'"),
        ({"key": -1}, "key=-1"),
        ({"key": True}, "key=True"),
        ({"key": 1.5}, "key=1.5"),
        ({"tasks": []}, "tasks=\\[\\]"),
        ({"tasks": [""]}, "tasks"),
        ({"header": ""}, "header=''"),
        ({"exchange": ""}, "exchange=''"),
        ({"cache_size": -1}, "cache_size=-1"),
    ],
)
def test_constructor_validates_eagerly_and_names_the_parameter(
    kwargs: dict[str, Any], fragment: str
) -> None:
    arguments: dict[str, Any] = {"queues": QUEUES, "key": "tenant_id", **kwargs}
    queues = arguments.pop("queues")
    with pytest.raises((TypeError, ValueError), match=fragment):
        ConsistentHashRouter(queues, **arguments)


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ConsistentHashRouter(QUEUES, "tenant_id")  # type: ignore[misc]


def test_statistics_counts_routes_and_cache() -> None:
    router = ConsistentHashRouter(QUEUES, key="tenant_id")
    for _ in range(3):
        route(router, kwargs={"tenant_id": "acme"})
    record = router.statistics()
    assert isinstance(record, RouterStatistics)
    assert record.routed[router.queue_for("acme")] == 3
    assert sum(record.routed.values()) == 3
    assert (record.cache_hits, record.cache_misses) == (2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.missing_errors = 1  # type: ignore[misc]


def test_uncached_router_agrees_with_cached() -> None:
    cached = ConsistentHashRouter(QUEUES, key="t")
    uncached = ConsistentHashRouter(QUEUES, key="t", cache_size=0)
    for i in range(500):
        assert cached.queue_for(f"k{i}") == uncached.queue_for(f"k{i}")
