"""Granite: the Llama layer with four multipliers: embeddings, attention scores (in place of
head_dim ** -0.5), block outputs before the residual add, and a divisor on the logits."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common
from worker_service.models.family import Family


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(
        config,
        architecture,
        embed_scale=float(config.embedding_multiplier),
        attention_scale=float(config.attention_multiplier),
        residual_scale=float(config.residual_multiplier),
        logits_divisor=float(config.logits_scaling),
    )


FAMILY = Family("granite", ("GraniteForCausalLM",), read_config)
