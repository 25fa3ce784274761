"""The noisy-neighbour showcase: plain Celery against celery-fair, measured on real brokers.

Four scenarios, each run with real ``celery worker -P prefork`` processes of
:mod:`celery_fair.testing.workload` on a real Redis or RabbitMQ:

A. **Flood** (:func:`~celery_fair.showcase.flood.run_flood`): one tenant
   submits a burst while quiet tenants trickle; routed by ``tenant_id`` onto
   shard queues. Waits (publish -> start) per quiet tenant, the flood's
   throughput.
B. **Heavy tasks** (:func:`~celery_fair.showcase.shares.run_heavy`): one
   tenant's tasks take 10x longer; the worker time each tenant gets.
C. **Tiers** (:func:`~celery_fair.showcase.shares.run_tiers`): premium and
   standard shards weighted 4:1 under full load; the achieved split.
D. **Slow worker** (:func:`~celery_fair.showcase.flood.run_flood` with a
   slowdown): one of two workers slows down during the flood.

:mod:`~celery_fair.showcase.runner` runs them with repetitions, alternating
the modes, and :mod:`~celery_fair.showcase.summary` turns the runs into
medians with spread, Markdown tables and a PNG chart. ``bench/noisy_neighbour.py``
and ``make demo`` are thin fronts for these modules.
"""
