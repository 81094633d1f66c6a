"""Phi-3 and Phi-4-mini: fused qkv_proj and gate_up_proj (taken as they are: q, k, v and
gate, up are already in the decoder's fused order), partial rotary (Phi-4-mini rotates 3/4 of each
head), longrope scaling, a model-wide sliding window."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common
from worker_service.models.family import Family


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture)


FAMILY = Family("phi3", ("Phi3ForCausalLM",), read_config)
