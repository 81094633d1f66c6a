"""Tiny random models shared by the worker tests (built once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.models import KINDS, load_hf, save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: save_tiny_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir: dict[str, Path]) -> tuple[Path, Any]:
    torch.set_num_threads(1)
    return tiny_model_dir["llama"], load_hf(tiny_model_dir["llama"])
