# Targets match the README. `setup` is idempotent: it rebuilds .venv only when pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast test-deploy lint typecheck protos bench clean

setup: $(STAMP)

# scripts/install.sh is the one list of what gets installed; the Dockerfile runs it too.
$(STAMP): pyproject.toml scripts/install.sh scripts/requirements.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install.sh $(BIN)/python dev --editable
	touch $(STAMP)

# `llmserve up` with its defaults: the embedded SmolLM2 on its shipped Q4_1 file's blocks
# (README, "Weights kept in GGUF blocks"); LLMSERVE_QUANT_MODE=exact serves HF's model.
serve: setup
	$(BIN)/llmserve up

# The whole suite but GPU-only tests (which need CUDA and are skipped without it) and the
# podman run of the compose stack (test-deploy). deploy/'s static checks are in here.
test: setup
	$(BIN)/python -m pytest -m "not gpu and not deploy" --durations=30 $(PYTEST_ARGS)

# In-process tests only: nothing marked `services` (starts processes) or `slow`.
test-fast: setup
	$(BIN)/python -m pytest -m "not gpu and not slow and not deploy and not services" $(PYTEST_ARGS)

# Builds the image on a Debian base and runs docker-compose.yml under podman (README,
# "Compose"); installs podman, runc and mmdebstrap when missing (needs root and apt).
test-deploy: setup
	scripts/install-podman.sh
	$(BIN)/python -m pytest -m deploy -p no:cacheprovider tests/deploy $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

protos: setup
	$(BIN)/python -m llmserve.protogen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
