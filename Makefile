# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck env bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

env: $(STAMP)

## Plan the built-in UNet at 2048x2048 for 8 GPUs, balanced by memory, and print the plan.
demo: $(STAMP)
	$(VENV)/bin/nowdl plan unet --input 1x3x2048x2048 --gpus 8 --balance memory --stages 8

lint: $(STAMP)
	$(VENV)/bin/ruff check nowdl tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Lint, type check and the whole test suite (slow cases included).
test: lint typecheck
	$(VENV)/bin/pytest -q

## The same without the cases marked slow.
test-fast: lint typecheck
	$(VENV)/bin/pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
