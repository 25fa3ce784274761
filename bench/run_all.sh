#!/usr/bin/env bash
# Runs every benchmark of the scheduler, one after the other (about 55 minutes on
# two cores). Results go to bench/results/.
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
