#!/usr/bin/env bash
# Runs the whole test suite: tests/, the benchmarks' own tests (bench/tests) and the
# example of celery_fair.testing (examples/testing).
# --durations=30 lists the slowest tests in the log.
# pytest exits 5 when it collects no test; that must fail loudly rather than
# pass as an empty success.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest --durations=30 tests bench/tests examples/testing "$@"
rc=$?
if [ "$rc" = 5 ]; then
    echo "run_tests: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
