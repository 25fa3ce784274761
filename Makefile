# Two entry points: `make demo` and `make test`. Both install what they need.
.PHONY: setup demo test lint typecheck unit integration bench

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m celery_fair.demo

lint: setup
	$(VENV)/bin/ruff check celery_fair tests bench examples
	$(VENV)/bin/ruff format --check celery_fair tests bench examples

typecheck: setup
	$(VENV)/bin/mypy celery_fair

unit: setup
	$(PY) -m pytest tests/unit -q

test: setup lint typecheck
	bash scripts/run_tests.sh

bench: setup
	$(PY) -m bench.dwrr_article
