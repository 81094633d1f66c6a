"""Mixture-of-experts families: Qwen3-MoE (Qwen3's attention; top-k of a float32 softmax,
renormalised when `norm_topk_prob`; dense MLPs on `mlp_only_layers` and off the
`decoder_sparse_step` grid) and Mixtral (Mistral's attention; top-2, always renormalised).
Experts are read as transformers 5 stores them, fused 3-D tensors (`weights.read_moe`)."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, MoeSpec, read_common
from worker_service.models.family import Family
from worker_service.models.weights import LayerWeights, read_layer, read_moe


def qwen3_moe_dense_layers(config: Any) -> frozenset[int]:
    """The layers with a dense MLP: `mlp_only_layers` and those off the
    `decoder_sparse_step` grid (all of them without experts)."""
    step = config.decoder_sparse_step
    return frozenset(
        i
        for i in range(config.num_hidden_layers)
        if i in set(config.mlp_only_layers) or not (config.num_experts > 0 and (i + 1) % step == 0)
    )


def read_qwen3_moe(config: Any, architecture: str) -> ModelArchConfig:
    moe = MoeSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(config.norm_topk_prob),
        dense_layers=qwen3_moe_dense_layers(config),
        round_weights=True,
    )
    return read_common(config, architecture, qk_norm="head", moe=moe)


def read_mixtral(config: Any, architecture: str) -> ModelArchConfig:
    moe = MoeSpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        norm_topk_prob=True,
    )
    return read_common(config, architecture, moe=moe)


def read_moe_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    assert arch.moe is not None
    if index in arch.moe.dense_layers:
        return read_layer(layer)
    return read_layer(layer, moe=read_moe(layer.mlp, layer.mlp.gate))


QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), read_qwen3_moe, read_moe_layer)
MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), read_mixtral, read_moe_layer)
