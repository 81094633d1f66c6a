"""Shared fixtures of the integration tests: one tiny model per session, and one stack of it
for the tests that only send it requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.models import build_tiny_llama, build_tiny_windowed
from tests.support.stack import TINY_SERVED_NAME, RunningStack, start_stack


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 whose local layers' window is far shorter than the tests' sequences: a
    hybrid KV layout (tests/support/models.py)."""
    return build_tiny_windowed(tmp_path_factory.mktemp("tiny-windowed"))


@pytest.fixture(scope="session")
def tiny_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    """The three services of the tiny model with their defaults, the gateway serving it as
    TINY_SERVED_NAME. Shared by modules whose tests send requests and leave it idle: none
    restarts, kills or reconfigures it."""
    running = start_stack(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("tiny-stack-logs"),
        gateway_args=["--served-model-name", TINY_SERVED_NAME],
    )
    yield running
    running.stop()
