# Targets match the README. `setup` is idempotent: it rebuilds .venv only when pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint typecheck protos bench clean

setup: $(STAMP)

# scripts/install.sh is the one list of what gets installed; the Dockerfile runs it too.
$(STAMP): pyproject.toml scripts/install.sh scripts/requirements.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install.sh $(BIN)/python dev --editable
	touch $(STAMP)

serve: setup
	$(BIN)/llmserve up

# The whole suite but GPU-only tests (which need CUDA and are skipped without it).
test: setup
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

protos: setup
	$(BIN)/python -m llmserve.protogen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
