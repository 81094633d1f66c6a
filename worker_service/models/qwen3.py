"""Qwen3: the Llama layer with a per-head RMSNorm on q and k before rotary, and an explicit
head_dim."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common
from worker_service.models.family import Family


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture, qk_norm="head")


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), read_config)
