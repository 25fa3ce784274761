# Two entry points: `make demo` and `make test`. Both install what they need.
.PHONY: setup demo test lint typecheck docs unit integration bench

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

docs: setup
	$(VENV)/bin/mkdocs build --strict

unit: setup
	$(PY) -m pytest tests/unit -q

test: setup lint typecheck docs
	bash scripts/run_tests.sh

bench: setup
	bash bench/run_all.sh
