"""The green pools on RabbitMQ: the DWRR dispatch decides the shares (issue #31, item 7).

A worker started with Celery's defaults on Celery 5.7 waited 100 ms on its
event connection at every turn of its loop and read about ten deliveries a
second; and eventlet's ``on_apply`` returns no greenlet, so celery-fair's gate
took every task as finished at once and eventlet's own pool ran them in
arrival order.  Either way the pool took each task as it arrived and the
dispatch order never chose: the shares were those of the windows and of the
broker's push.
"""

from __future__ import annotations

import pytest

from bench.harness.harness import run_backlogged

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq, pytest.mark.compat]

#: The DWRR article's ten queues and quanta.
QUANTA = {f"p{i}": 4 * (i + 1) for i in range(10)}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in QUANTA.items())
WINDOW = 10


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_green_pools_serve_the_article_quanta_from_equal_windows(
    rabbitmq_server: object, pool: str
) -> None:
    # Equal per-queue windows (fair_prefetch=10) take the windows out of the
    # shares: a queue's share can only come from the DWRR dispatch order, which
    # chooses only when deliveries are read ahead of the pool. Without it every
    # queue gets a tenth (p0 10% for 1.8%, p9 10% for 18.2%).
    #
    # Tolerance: consumption is counted at the broker (deliveries), which runs
    # ahead of the dispatch by at most a window per queue, and the harness
    # samples every 5 ms (a few tasks): (10 + 5) / 2,200 is 0.7 points of share
    # at each end of the interval; 1.5 points allowed, against the 8.2-point
    # error of flattened shares. 2,200 tasks are ten DWRR rounds of 220.
    result = run_backlogged(
        rabbitmq_server.url,  # type: ignore[attr-defined]
        dict.fromkeys(QUANTA, 800),
        target=2200,
        warmup=300,  # past the start, when every window fills at once (100)
        pool=pool,
        args=(100,),
        env={"CELERY_FAIR_PREFETCH": str(WINDOW)},
        extra_args=["--fair-weights", WEIGHT_ARG],
        timeout=150,
    )
    total = sum(QUANTA.values())
    shares = result.shares()
    for queue, quantum in QUANTA.items():
        assert shares[queue] == pytest.approx(quantum / total, abs=0.015), shares
