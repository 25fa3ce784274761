#!/usr/bin/env bash
# `make bench`: makes again every result set in bench/results/ that the README and
# the docs cite and that measures the code as it is, each with the command that made
# it (bench/results/README.md lists them, the command beside each). Several hours on
# two cores; the longest are the noisy-neighbour showcase (about 20 minutes per
# broker), Celery's own integration suite (about 40 and 30 minutes) and the churn
# soak (about 30). Results go to bench/results/.
#
# Not here: the version matrix (`make test-matrix`, which writes matrix.md), and the
# result sets that record other code (the *_before files, earlier runs, the
# analytics changes measured one commit after the other, the comparisons of fixed
# revisions by bench.revisions, Celery 5.6.3's integration run): rerun at this
# commit they would measure something else. Their commands are in the README there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

# The scheduler (README "The scheduler benchmarks")
$PY -m bench.decision_cost
$PY -m bench.dwrr_article --broker redis
$PY -m bench.dwrr_article --broker rabbitmq --pools prefork threads
$PY -m bench.dwrr_article --broker redis --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.dwrr_article --broker rabbitmq --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.dwrr_article --pools prefork --name dwrr_article_redis_atomic
$PY -m bench.dwrr_article --pools threads solo --name dwrr_article_redis_atomic_threads_solo
$PY -m bench.dwrr_article --pools solo --name dwrr_article_redis_solo
$PY -m bench.runtime_cost
$PY -m bench.memory --tasks 100000
$PY -m bench.telemetry_overhead
$PY -m bench.soak --minutes 4.5
$PY -m bench.soak --minutes 2 --plain

# Versions and pools (docs/compatibility.md)
$PY -m bench.idle_latency --samples 60 --reps 3
$PY -m bench.dwrr_article --broker rabbitmq --pools gevent eventlet --task-us 100 \
    --reps 3 --per-queue 1500 --target 1000 --name dwrr_article_rabbitmq_green

# Routing (docs/routing.md)
$PY -m bench.router --alternatives
$PY -m bench.router --apply-async

# The noisy neighbour (README, docs/noisy-neighbour.md, docs/fairness-keys.md)
$PY -m bench.noisy_neighbour --broker redis --scenarios A,B,C,D --reps 3
$PY -m bench.noisy_neighbour --broker rabbitmq --scenarios A,B,C,D --reps 3
$PY -m bench.noisy_neighbour --broker redis --scenarios A --reps 2 --modes fair,fair-isolated \
    --name noisy_neighbour_redis_isolated
$PY -m bench.noisy_neighbour --broker redis --scenarios K --reps 3 --name noisy_neighbour_redis_keys
$PY -m bench.noisy_neighbour --broker redis --scenarios K --reps 3 \
    --name noisy_neighbour_redis_keys_run2
$PY -m bench.noisy_neighbour --broker rabbitmq --scenarios K --reps 3 --flood 8000 \
    --name noisy_neighbour_rabbitmq_keys
$PY -m bench.noisy_neighbour --broker rabbitmq --scenarios K --reps 3 --flood 8000 --broker-core 1 \
    --name noisy_neighbour_rabbitmq_keys_broker_core
$PY -m bench.wait_split --broker rabbitmq --flood 8000 --reps 3
$PY -m bench.wait_split --broker rabbitmq --flood 8000 --reps 3 --broker-core 1 \
    --name wait_split_rabbitmq_broker_core

# Fairness keys (docs/fairness-keys.md)
$PY -m bench.keys_scale --keys 10,10000,1000000 --reps 3 --consume 20000
$PY -m bench.key_limits --reps 3 --rate-seconds 30 --task-ms 0,10,50
$PY -m bench.tenants --reps 3 --only shares,flood,cost,throughput

# The slow consumer (docs/codel.md)
$PY -m bench.codel_slow_consumer --broker redis --reps 2
$PY -m bench.codel_slow_consumer --broker rabbitmq --reps 4
$PY -m bench.codel_slow_consumer --broker redis --reps 2 --rate 75 --tag rate75
$PY -m bench.codel_slow_consumer --broker rabbitmq --reps 2 --rate 75 --tag rate75

# FairConsumerMixin (docs/kombu.md)
$PY -m bench.mixin_idle --duration 5.0 --reps 3 --shares-reps 9 --handled 20000
$PY -m bench.mixin_idle --duration 5.0 --reps 1 --shares-reps 9 --handled 20000 --only rabbitmq \
    --pin-broker
$PY -m bench.mixin_idle --duration 2.0 --reps 1 --shares-reps 9 --handled 20000 --only rabbitmq \
    --name mixin_idle_rabbitmq

# Operations (docs/operations.md, docs/monitoring.md, docs/scheduled.md)
$PY -m bench.redis_capacity --reps 2 --servers redis \
    --paths brpop,atomic,keyed-10,keyed-10000,limits-10,limits-10000 --batch 4 --tasks 8000 \
    --name redis_capacity_batch4
$PY -m bench.broker_cost --variants plain,fair,keyed-1000,limits-1000,limits-10000 --reps 3 \
    --tasks 12000
$PY -m bench.broker_full --reps 2 --maxmemory 40mb --full-for 8
$PY -m bench.replacement_stall --broker rabbitmq --reps 3 --tasks 3000
CELERY_FAIR_TEST_SERVER=valkey $PY -m bench.broker_full --reps 2 --maxmemory 40mb --full-for 8 \
    --name broker_full_valkey
$PY -m bench.redis_crash_loss --runs 10 --tasks 1500 --modes plain,fair
$PY -m bench.scheduled --scenarios visibility,hoard,ontime
$PY -m bench.failover --reps 1 --failovers 10 --rate 60 --modes plain,fair
$PY -m bench.exporter_scrape --keys 10 10000 1000000 --reps 7
$PY -m bench.soak --churn --tasks 100000 --reps 1

# The telemetry report (docs/analytics.md)
$PY -m bench.analytics --sizes 100000,1000000,10000000 --reps 3,3,1
$PY -m bench.analytics --sizes 100000,1000000 --reps 1,2 --cluster --name analytics_cluster
$PY -m bench.analytics --sizes 1000000,4000000,10000000 --reps 3,3,3 --shape tenants \
    --name analytics_tenants
# The cost over the number of keys: 200, 16,000, 25,000, 100,000 and 1,000,000 keys
# in all over 4 queues (--keys is per queue; its default, 50, gives the 200)
$PY -m bench.analytics --sizes 10000000 --reps 3 --key-skew 0 --name analytics_keys_curve_200
$PY -m bench.analytics --sizes 10000000 --reps 3 --keys 4000 --key-skew 0 \
    --name analytics_keys_curve_16000
$PY -m bench.analytics --sizes 10000000 --reps 3 --keys 6250 --key-skew 0 \
    --name analytics_keys_curve_25000
$PY -m bench.analytics --sizes 10000000 --reps 3 --keys 25000 --key-skew 0 \
    --name analytics_keys_curve_100000
$PY -m bench.analytics --sizes 10000000 --reps 3 --keys 250000 --key-skew 0 \
    --name analytics_keys_curve_1000000

# Celery's own integration suite (docs/compatibility.md, bench/celery_integration/README.md);
# last: it exits 1 if a test passed plain and failed with celery-fair.
$PY -m bench.celery_integration
$PY -m bench.celery_integration --worker embedded --runs plain fair
