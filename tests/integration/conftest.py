"""Shared fixtures of the integration tests: one tiny model per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import build_tiny_llama, build_tiny_windowed


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 whose local layers' window is far shorter than the tests' sequences: a
    hybrid KV layout (tests/support/models.py)."""
    return build_tiny_windowed(tmp_path_factory.mktemp("tiny-windowed"))
