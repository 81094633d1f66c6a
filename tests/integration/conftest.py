"""Shared fixtures of the integration tests: one tiny model per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
