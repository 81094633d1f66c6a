"""Gemma 4 (text): Gemma 3's layer (four norms, per-head q/k norms, GeGLU, scaled embeddings,
a rotary table per layer type) with norms that apply their weight in float32 (no 1 + w),
values RMS-normalized per head, scores unscaled (scale 1), a learned scalar on each layer's
output, and these options of the config:

- per-layer inputs (`hidden_size_per_layer_input`): see `per_layer_inputs`;
- KV sharing (`num_kv_shared_layers`): the last layers project no K/V and read those of the
  last earlier layer of their type (`LayerKind.kv_source`), storing none;
- `attention_k_eq_v`: full-attention layers without a value projection use their keys'
  projection for the values (normalized as values, not as keys);
- proportional rotary on the global layers (frequencies for part of the head, the rest zero);
- double-wide MLPs on the KV-shared layers (`use_double_wide_mlp`): wider weights, nothing else;
- an expert block beside every dense MLP (`enable_moe_block`, `moe.parallel_moe_mlp`);
- per-layer attention shapes (`per_layer_config`: the global layers' `global_head_dim` and
  `num_global_key_value_heads`), as `LayerKind.head_dim` and `num_kv_heads`: the KV cache
  gives each layer as many slots as its width takes (`llmserve.kv_layout`).

`Gemma4ForConditionalGeneration` checkpoints load their text model (the vision and audio
towers are not used). Refused by name: bidirectional attention over all tokens, a layer
type whose layers differ in shape, and a per-layer input vocabulary smaller than the
model's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from worker_service.models.arch import (
    LayerKind,
    ModelArchConfig,
    MoeSpec,
    read_activation,
    read_common,
    read_layer_kinds,
    read_ropes_by_layer_type,
)
from worker_service.models.family import Family
from worker_service.models.gemma import multimodal_text_config, multimodal_text_parts
from worker_service.models.per_layer_inputs import PerLayerInputWeights
from worker_service.models.rope import UnsupportedModelError
from worker_service.models.weights import LayerWeights, MoeWeights, read_layer, read_moe


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    with _global_values(config):
        return _read_config(config, architecture)


@contextmanager
def _global_values(config: Any) -> Iterator[None]:
    """Let `config.head_dim` and `num_key_value_heads` read the config's own values while a
    `per_layer_config` overrides them for some layers (transformers refuses such reads
    unless asked): they are the model's shape, which `LayerKind` overrides per layer."""
    flag = "allow_global_per_layer_attribute_access"
    before = getattr(config, flag, None)
    if before is None:  # a config without per-layer attributes
        yield
        return
    setattr(config, flag, True)
    try:
        yield
    finally:
        setattr(config, flag, before)


def _read_config(config: Any, architecture: str) -> ModelArchConfig:
    _refuse_unrun_features(config)
    shapes = _shapes_by_type(config)
    ropes, rope_of_type = read_ropes_by_layer_type(
        config, {t: head_dim for t, (_, head_dim) in shapes.items()}
    )
    layers = read_layer_kinds(config, config.num_hidden_layers, rope_of_type=rope_of_type)
    types = config.layer_types[: config.num_hidden_layers]
    layers = tuple(
        _with_shape(kind, shapes[t], config) for kind, t in zip(layers, types, strict=True)
    )
    per_layer = config.hidden_size_per_layer_input or None
    return read_common(
        config,
        architecture,
        ropes=ropes,
        layers=_with_kv_sources(config, layers),
        norm="rms_f32",
        qk_norm="head",
        activation=read_activation(config, "hidden_activation", "hidden_act"),
        attention_scale=1.0,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        embed_scale=float(config.hidden_size) ** 0.5,
        round_embed_scale=True,
        output_norms=True,
        value_norm=True,
        per_layer_input_size=per_layer,
        layer_scalars=True,
        moe=_moe_spec(config),
    )


def _refuse_unrun_features(config: Any) -> None:
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise UnsupportedModelError(
            "use_bidirectional_attention 'all' is not supported (causal attention only)"
        )
    if config.hidden_size_per_layer_input and config.vocab_size_per_layer_input < config.vocab_size:
        raise UnsupportedModelError(
            f"vocab_size_per_layer_input {config.vocab_size_per_layer_input} smaller than "
            f"vocab_size {config.vocab_size} is not supported"
        )


def _shapes_by_type(config: Any) -> dict[str, tuple[int, int]]:
    """Layer type -> its layers' (num_kv_heads, head_dim) from `per_layer_config`; refuses a
    type whose layers differ (a rotary table and a KV group serve a type)."""
    shapes: dict[str, set[tuple[int, int]]] = {}
    for i, layer_type in enumerate(config.layer_types[: config.num_hidden_layers]):
        layer = config.per_layer_config[i]
        shapes.setdefault(layer_type, set()).add((layer.num_key_value_heads, layer.head_dim))
    for layer_type, found in shapes.items():
        if len(found) > 1:
            described = ", ".join(f"{h} kv heads x head_dim {d}" for h, d in sorted(found))
            raise UnsupportedModelError(
                f"per_layer_config: {layer_type} layers of different shapes ({described})"
            )
    return {layer_type: next(iter(found)) for layer_type, found in shapes.items()}


def _with_shape(kind: LayerKind, shape: tuple[int, int], config: Any) -> LayerKind:
    """`kind` with its own K/V heads and head size where they differ from the config's."""
    num_kv_heads, head_dim = shape
    return replace(
        kind,
        num_kv_heads=None if num_kv_heads == config.num_key_value_heads else num_kv_heads,
        head_dim=None if head_dim == config.head_dim else head_dim,
    )


def _with_kv_sources(config: Any, layers: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
    """Each of the last `num_kv_shared_layers` layers reads the K/V of the last layer before
    them of its type."""
    types = list(config.layer_types)
    first_shared = len(layers) - (config.num_kv_shared_layers or 0)
    kinds = list(layers)
    for i in range(first_shared, len(layers)):
        sources = [j for j in range(first_shared) if types[j] == types[i]]
        if not sources:
            raise UnsupportedModelError(
                f"num_kv_shared_layers {config.num_kv_shared_layers}: layer {i} "
                f"({types[i]}) has no earlier {types[i]} layer that stores K/V"
            )
        kinds[i] = replace(kinds[i], kv_source=sources[-1])
    return tuple(kinds)


def _moe_spec(config: Any) -> MoeSpec | None:
    if not config.enable_moe_block:
        return None
    return MoeSpec(
        num_experts=config.num_experts,
        top_k=config.top_k_experts,
        intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=True,
        routing="scaled_softmax_topk",
        beside_dense=True,
    )


def read_gemma4_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    weights = read_layer(
        layer,
        input_norm="input_layernorm",
        attn_out_norm="post_attention_layernorm",
        post_norm="pre_feedforward_layernorm",
        mlp_out_norm="post_feedforward_layernorm",
        moe=_read_experts(layer) if arch.moe is not None else None,
        dense_beside_moe=True,
        kv_shared=arch.layers[index].kv_source is not None,
    )
    if arch.per_layer_input_size is not None:
        weights.per_layer_gate = layer.per_layer_input_gate.weight.detach()
        weights.per_layer_proj = layer.per_layer_projection.weight.detach()
        weights.per_layer_norm = layer.post_per_layer_input_norm.weight.detach()
    weights.layer_scalar = layer.layer_scalar.detach()
    return weights


def _read_experts(layer: Any) -> MoeWeights:
    experts = read_moe(layer, layer.router.proj)
    experts.router_scale = layer.router.scale.detach()
    experts.expert_scale = layer.router.per_expert_scale.detach()
    experts.input_norm = layer.pre_feedforward_layernorm_2.weight.detach()
    experts.out_norm = layer.post_feedforward_layernorm_2.weight.detach()
    experts.dense_out_norm = layer.post_feedforward_layernorm_1.weight.detach()
    return experts


def read_per_layer_inputs(inner: Any, arch: ModelArchConfig) -> PerLayerInputWeights | None:
    if arch.per_layer_input_size is None:
        return None
    return PerLayerInputWeights(
        embed=inner.embed_tokens_per_layer.weight.detach(),
        projection=inner.per_layer_model_projection.weight.detach(),
        norm=inner.per_layer_projection_norm.weight.detach(),
    )


FAMILY = Family(
    "gemma4",
    ("Gemma4ForCausalLM",),
    read_config,
    read_gemma4_layer,
    read_per_layer_inputs=read_per_layer_inputs,
)
MULTIMODAL = Family(
    "gemma4",
    ("Gemma4ForConditionalGeneration",),
    read_config,
    read_gemma4_layer,
    text_config=multimodal_text_config,
    text_parts=multimodal_text_parts,
    read_per_layer_inputs=read_per_layer_inputs,
)
