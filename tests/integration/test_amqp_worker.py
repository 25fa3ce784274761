"""Per-queue windows and DWRR dispatch on RabbitMQ, with the real ``celery worker``."""

from __future__ import annotations

import pytest

from tests.harness.harness import run_backlogged

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]
compat = pytest.mark.compat

WEIGHTS = {"w1": 1, "w2": 2, "w3": 3, "w4": 4}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in WEIGHTS.items())


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param("prefork", marks=compat),
        pytest.param("threads", marks=compat),
        pytest.param("solo", marks=compat),
        pytest.param("gevent", marks=compat),
        pytest.param("eventlet", marks=compat),
    ],
)
def test_shares_follow_weights_on_rabbitmq(rabbitmq_server: object, pool: str) -> None:
    # 1,000 tasks are 100 DWRR rounds of 1+2+3+4: a share is off by at most a
    # round's part at each end of the interval (0.8% for weight 4), within the
    # tolerance. More would only cost time where acks are slow: -P threads on
    # Celery 5.3 runs about 8 tasks/s on RabbitMQ, plain Celery too
    # (celery/celery#6941).
    result = run_backlogged(
        rabbitmq_server.url,  # type: ignore[attr-defined]
        dict.fromkeys(WEIGHTS, 1200),
        target=1000,
        warmup=100,  # past the start, when every window fills at once
        pool=pool,
        args=(100,),
        extra_args=["--fair-weights", WEIGHT_ARG],
    )
    for queue, weight in WEIGHTS.items():
        assert result.shares()[queue] == pytest.approx(weight / 10, abs=0.025), result.shares()


def test_plain_celery_on_rabbitmq_flattens(rabbitmq_server: object) -> None:
    result = run_backlogged(
        rabbitmq_server.url,  # type: ignore[attr-defined]
        dict.fromkeys(WEIGHTS, 800),
        target=1200,
        warmup=50,
        fair=False,
        args=(100,),
    )
    assert max(result.shares().values()) < 0.32


@pytest.mark.parametrize(
    ("broker", "pool"),
    [
        pytest.param("redis", "prefork"),
        pytest.param("rabbitmq", "prefork", marks=compat),
        pytest.param("redis", "gevent", marks=compat),
        pytest.param("rabbitmq", "gevent"),
        pytest.param("redis", "eventlet"),
        pytest.param("rabbitmq", "eventlet", marks=compat),
    ],
)
def test_flood_cannot_starve_a_weight_one_queue(
    request: pytest.FixtureRequest, broker: str, pool: str
) -> None:
    # The flood is 5x deeper and weighs 3; the quiet queue keeps its 1/4.  Tasks
    # of 5 ms keep the pool the bottleneck, so tasks wait for a slot and the
    # DWRR dispatch decides (with 1 ms tasks the prefork main process is the
    # bottleneck and tasks run in arrival order).
    server = request.getfixturevalue("redis_server" if broker == "redis" else "rabbitmq_server")
    result = run_backlogged(
        server.url,
        {"flood": 3000, "quiet": 600},
        target=800,
        warmup=100,  # past the start, when every window fills at once
        pool=pool,
        task="nap",
        args=(5,),
        extra_args=["--fair-weights", "flood=3,quiet=1"],
    )
    assert result.shares()["quiet"] == pytest.approx(0.25, abs=0.03)


@compat
def test_quorum_queues_keep_working(rabbitmq_server: object) -> None:
    # Celery detects quorum queues and switches to per-consumer QoS.
    result = run_backlogged(
        rabbitmq_server.url,  # type: ignore[attr-defined]
        {"qa": 1500, "qb": 1500},
        target=1000,
        warmup=150,  # past the start, when every window fills at once
        args=(100,),
        env={"CELERY_FAIR_QUORUM_QUEUES": "qa,qb"},
        extra_args=["--fair-weights", "qa=3,qb=1"],
    )
    shares = result.shares()
    assert shares["qa"] == pytest.approx(0.75, abs=0.03), (result.consumed, result.elapsed)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_two_workers_keep_the_combined_shares(request: pytest.FixtureRequest, broker: str) -> None:
    url = request.getfixturevalue("redis_server" if broker == "redis" else "rabbitmq_server").url
    result = run_backlogged(
        url,
        dict.fromkeys(WEIGHTS, 900),
        target=1500,
        warmup=100,
        workers=2,
        concurrency=1,
        args=(100,),
        extra_args=["--fair-weights", WEIGHT_ARG],
    )
    for queue, weight in WEIGHTS.items():
        assert result.shares()[queue] == pytest.approx(weight / 10, abs=0.025), result.shares()
