"""Tiny random models shared by the worker tests (built once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .factories import load_hf, save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: save_tiny_model(kind, root) for kind in ("llama", "llama3", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir: dict[str, Path]) -> tuple[Path, Any]:
    torch.set_num_threads(1)
    return tiny_model_dir["llama"], load_hf(tiny_model_dir["llama"])
