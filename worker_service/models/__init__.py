"""Model implementations the worker runs over the paged KV cache: one decoder
(`decoder.DecoderModel`) and one module per family, found through `registry`."""

from __future__ import annotations

from worker_service.models.arch import ModelArchConfig
from worker_service.models.decoder import DecoderModel, LlamaModel
from worker_service.models.registry import SUPPORTED_ARCHITECTURES, model_from_hf, read_arch
from worker_service.models.rope import UnsupportedModelError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "LlamaModel",
    "ModelArchConfig",
    "UnsupportedModelError",
    "model_from_hf",
    "read_arch",
]
