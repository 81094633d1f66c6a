"""Model implementations the worker runs over the paged KV cache."""

from __future__ import annotations

from worker_service.models.llama import SUPPORTED_ARCHITECTURES, LlamaModel, ModelArchConfig
from worker_service.models.rope import UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaModel", "ModelArchConfig", "UnsupportedModelError"]
