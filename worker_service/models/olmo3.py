"""OLMo 3: OLMo 2's block (see `olmo2`) with sliding windows on `sliding_attention` layers
(three in four unless `layer_types` says otherwise) and a rotary table per layer type."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import (
    ModelArchConfig,
    read_common,
    read_head_dim,
    read_layer_kinds,
    read_ropes_by_layer_type,
)
from worker_service.models.family import Family
from worker_service.models.olmo2 import FEATURES, read_olmo2_layer
from worker_service.models.rope import RopeSpec, UnsupportedModelError


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    ropes, rope_of_type = read_ropes_by_layer_type(config)
    _refuse_unrun_features(config, ropes)
    layers = read_layer_kinds(config, config.num_hidden_layers, rope_of_type=rope_of_type)
    return read_common(config, architecture, ropes=ropes, layers=layers, **FEATURES)


def _refuse_unrun_features(config: Any, ropes: tuple[RopeSpec, ...]) -> None:
    """Settings the reference model does not run, so there is nothing to match: a sliding
    layer with no window (transformers fails) and partial rotary (it rotates every dim of
    a head, failing on a narrower table or ignoring the factor)."""
    if "sliding_attention" in (config.layer_types or []) and not config.sliding_window:
        raise UnsupportedModelError(
            "sliding_window must be set when layer_types has sliding_attention layers"
        )
    if any(rope.rotary_dim != read_head_dim(config) for rope in ropes):
        raise UnsupportedModelError(
            "partial_rotary_factor is not supported (OLMo 3 rotates every dim of a head)"
        )


FAMILY = Family("olmo3", ("Olmo3ForCausalLM",), read_config, read_olmo2_layer)
