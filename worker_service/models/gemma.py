"""Gemma 2 and Gemma 3 (text): norms that scale by (1 + weight) in float32, four norms a
layer (before and after attention, before and after the MLP), GeGLU, embeddings times
sqrt(hidden) rounded to the weight dtype, scores scaled by query_pre_attn_scalar ** -0.5,
sliding windows on `sliding_attention` layers. Gemma 2 soft-caps attention scores and final
logits; Gemma 3 normalizes q and k per head and gives local and global layers their own
rotary tables. `Gemma3ForConditionalGeneration` checkpoints load their text model."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import (
    ModelArchConfig,
    read_activation,
    read_common,
    read_layer_kinds,
    read_ropes_by_layer_type,
)
from worker_service.models.family import Family
from worker_service.models.rope import UnsupportedModelError
from worker_service.models.weights import LayerWeights, read_layer


def _gemma_features(config: Any) -> dict[str, Any]:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "use_bidirectional_attention is not supported (causal attention only)"
        )
    return dict(
        norm="gemma",
        activation=read_activation(config, "hidden_activation", "hidden_act"),
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        embed_scale=float(config.hidden_size) ** 0.5,
        round_embed_scale=True,
        output_norms=True,
    )


def read_gemma2(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture, **_gemma_features(config))


def read_gemma3(config: Any, architecture: str) -> ModelArchConfig:
    ropes, rope_of_type = read_ropes_by_layer_type(config)
    layers = read_layer_kinds(config, config.num_hidden_layers, rope_of_type=rope_of_type)
    return read_common(
        config,
        architecture,
        ropes=ropes,
        layers=layers,
        qk_norm="head",
        **_gemma_features(config),
    )


def read_gemma_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_layer(
        layer,
        input_norm="input_layernorm",
        attn_out_norm="post_attention_layernorm",
        post_norm="pre_feedforward_layernorm",
        mlp_out_norm="post_feedforward_layernorm",
    )


def multimodal_text_config(config: Any) -> Any:
    return getattr(config, "text_config", config)


def multimodal_text_parts(hf_model: Any) -> tuple[Any, Any]:
    inner = hf_model.model
    return getattr(inner, "language_model", inner), hf_model.lm_head


GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), read_gemma2, read_gemma_layer)
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), read_gemma3, read_gemma_layer)
GEMMA3_MULTIMODAL = Family(
    "gemma3",
    ("Gemma3ForConditionalGeneration",),
    read_gemma3,
    read_gemma_layer,
    text_config=multimodal_text_config,
    text_parts=multimodal_text_parts,
)
