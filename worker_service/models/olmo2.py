"""OLMo 2: no norm before attention or MLP; each block's output is normalized before the
residual add (weight applied in float32), and q and k are normalized over their whole
projection width before being split into heads."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common
from worker_service.models.family import Family
from worker_service.models.weights import LayerWeights, read_layer

# ModelArchConfig fields of OLMo 2's block (OLMo 3 keeps it).
FEATURES: dict[str, Any] = dict(
    norm="rms_f32", qk_norm="full", input_norms=False, output_norms=True
)


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture, **FEATURES)


def read_olmo2_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_layer(
        layer,
        input_norm=None,
        attn_out_norm="post_attention_layernorm",
        post_norm=None,
        mlp_out_norm="post_feedforward_layernorm",
    )


FAMILY = Family("olmo2", ("Olmo2ForCausalLM",), read_config, read_olmo2_layer)
