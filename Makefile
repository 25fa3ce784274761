# Two entry points: `make demo` and `make test`. Both install what they need.
.PHONY: setup demo test lint typecheck docs unit integration bench test-matrix test-matrix-ci

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m bench.demo

lint: setup
	$(VENV)/bin/ruff check celery_fair tests bench examples noxfile.py
	$(VENV)/bin/ruff format --check celery_fair tests bench examples noxfile.py
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy celery_fair

docs: setup
	$(VENV)/bin/mkdocs build --strict

unit: setup
	$(PY) -m pytest tests/unit bench/tests -q -m "not integration"

test: setup lint typecheck docs
	bash scripts/run_tests.sh

bench: setup
	bash bench/run_all.sh

# The version matrix (Celery 5.3-5.7 with their Kombu and redis-py): the
# compatibility tests and a small DWRR benchmark in every set, the compatibility
# tests again with Valkey as the server (newest set), then the table
# in bench/results/matrix.md.  About 105 minutes.
test-matrix: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/nox -s compat valkey matrix_bench
	$(PY) -m bench.matrix

# What CI runs besides `make test` (the whole suite in the project's venv, the
# newest version set): the compatibility and deployment tests in the oldest set,
# and in the newest set too when the project's venv is not that set or newer.
test-matrix-ci: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/nox -s ci
