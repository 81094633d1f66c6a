"""Llama 2/3, Mistral and Qwen2: the Llama layer (RMSNorm, q/k/v with optional biases,
rotary, SwiGLU), Mistral's model-wide sliding window, Qwen2's per-layer windows."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common
from worker_service.models.family import Family


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture)


FAMILY = Family(
    "llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), read_config
)
