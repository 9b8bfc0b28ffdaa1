VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lint format docs bench

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/weir demo

test: setup
	$(PY) -m pytest -q --durations=15

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check weir tests benchmarks
	$(VENV)/bin/ruff format --check weir tests benchmarks

format:
	$(VENV)/bin/ruff check --fix weir tests benchmarks
	$(VENV)/bin/ruff format weir tests benchmarks

docs: setup
	$(VENV)/bin/weir config-docs --out docs/configuration.md

bench: setup
	$(PY) benchmarks/engine_throughput.py
