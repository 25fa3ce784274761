#!/usr/bin/env bash
# Runs every benchmark, one after the other (about 110 minutes on two cores; the
# noisy-neighbour showcase is about 20 minutes per broker, the crash-loss runs about
# 25). Results go to bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m bench.decision_cost
$PY -m bench.dwrr_article --broker redis
$PY -m bench.dwrr_article --broker rabbitmq --pools prefork threads
$PY -m bench.dwrr_article --broker redis --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.dwrr_article --broker rabbitmq --workers 2 --concurrency 1 --pools prefork --task-us 100
$PY -m bench.runtime_cost
$PY -m bench.telemetry_overhead
$PY -m bench.memory
$PY -m bench.soak
$PY -m bench.noisy_neighbour --broker redis --reps 3
$PY -m bench.noisy_neighbour --broker rabbitmq --reps 3
$PY -m bench.redis_crash_loss
