"""The noisy-neighbour showcase: plain Celery against celery-fair, measured on real brokers.

Four scenarios, each run with real ``celery worker -P prefork`` processes of
:mod:`tests.harness.workload` on a real Redis or RabbitMQ:

A. **Flood** (:func:`~bench.showcase.flood.run_flood`): one tenant
   submits a burst while quiet tenants trickle; routed by ``tenant_id`` onto
   shard queues. Waits (publish -> start) per quiet tenant, the flood's
   throughput.
B. **Heavy tasks** (:func:`~bench.showcase.shares.run_heavy`): one
   tenant's tasks take 10x longer; the worker time each tenant gets.
C. **Tiers** (:func:`~bench.showcase.shares.run_tiers`): premium and
   standard shards weighted 4:1 under full load; the achieved split.
D. **Slow worker** (:func:`~bench.showcase.flood.run_flood` with a
   slowdown): one of two workers slows down during the flood.

:mod:`~bench.showcase.runner` runs them with repetitions, alternating
the modes, and :mod:`~bench.showcase.summary` turns the runs into
medians with spread, Markdown tables and a PNG chart. ``bench/noisy_neighbour.py``
and ``make demo`` are thin fronts for these modules.
"""
