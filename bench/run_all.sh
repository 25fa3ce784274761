#!/usr/bin/env bash
# Runs every benchmark the README and the docs cite, one after the other (about
# three hours on two cores; the noisy-neighbour showcase is about 20 minutes per
# broker, the crash-loss runs about 25). Results go to bench/results/. The version
# matrix (bench.matrix) has its own command: make test-matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m bench.decision_cost
$PY -m bench.router
$PY -m bench.dwrr_article --broker redis
$PY -m bench.dwrr_article --broker rabbitmq --pools prefork threads
$PY -m bench.dwrr_article --broker redis --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.dwrr_article --broker rabbitmq --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.idle_latency
$PY -m bench.runtime_cost
$PY -m bench.telemetry_overhead
$PY -m bench.memory
$PY -m bench.mixin_idle
$PY -m bench.codel_slow_consumer --broker redis
$PY -m bench.codel_slow_consumer --broker rabbitmq
$PY -m bench.keys_shares --reps 3
$PY -m bench.keys_scale --reps 3
$PY -m bench.key_limits
$PY -m bench.soak
$PY -m bench.noisy_neighbour --broker redis --reps 3
$PY -m bench.noisy_neighbour --broker rabbitmq --reps 3
$PY -m bench.redis_crash_loss
$PY -m bench.redis_crash_loss --runs 10 --modes plain,fair-keyed
$PY -m bench.redis_crash_loss --runs 10 --modes plain,fair-keyed-priorities --name redis_crash_loss_priorities
$PY -m bench.priorities --reps 3
$PY -m bench.analytics
$PY -m bench.celery_integration
