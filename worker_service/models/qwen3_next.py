"""Qwen3-Next: Qwen3.5-MoE's hybrid (see `qwen3_5`) before it, with two differences: the
Gated DeltaNet layers project q/k/v/z and b/a in two matmuls laid out per key head (each key
head's q, k, then its value heads' v and z; its value heads' b, then a), which are reordered
at load into the mixer's layout, and dense MLPs where Qwen3-MoE has them (`mlp_only_layers`,
off the `decoder_sparse_step` grid). The top-k renormalisation follows `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

import torch

from worker_service.models.arch import LinearAttentionSpec, ModelArchConfig, MoeSpec, read_common
from worker_service.models.family import Family
from worker_service.models.mixture import qwen3_moe_dense_layers
from worker_service.models.qwen3_5 import hybrid_features, read_hybrid_layer
from worker_service.models.weights import LayerWeights


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    dense = qwen3_moe_dense_layers(config)
    moe = None
    if len(dense) < config.num_hidden_layers:
        moe = MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            dense_layers=dense,
            round_weights=True,
            shared_expert_size=config.shared_expert_intermediate_size,
        )
    return read_common(config, architecture, moe=moe, **hybrid_features(config))


def _in_proj(mixer: Any, spec: LinearAttentionSpec) -> torch.Tensor:
    """in_proj_qkvz and in_proj_ba, grouped per key head, as q, k, v, z, b, a rows."""
    per_key = spec.num_v_heads // spec.num_k_heads  # value heads per key head
    v_rows = per_key * spec.v_dim
    hidden = mixer.in_proj_qkvz.weight.shape[1]
    qkvz = mixer.in_proj_qkvz.weight.detach().view(spec.num_k_heads, -1, hidden)
    q, k, v, z = qkvz.split([spec.k_dim, spec.k_dim, v_rows, v_rows], dim=1)
    ba = mixer.in_proj_ba.weight.detach().view(spec.num_k_heads, 2 * per_key, hidden)
    b, a = ba.split([per_key, per_key], dim=1)
    return torch.cat([part.reshape(-1, hidden) for part in (q, k, v, z, b, a)])


def read_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_hybrid_layer(layer, arch, index, _in_proj)


FAMILY = Family("qwen3_next", ("Qwen3NextForCausalLM",), read_config, read_layer)
