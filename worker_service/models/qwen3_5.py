"""Qwen3.5 and Qwen3.5-MoE (text): hybrids of Gated DeltaNet layers (`linear_attention` in
`layer_types`, three in four by default; `delta_net`) and gated full attention: the query
projection yields a query and an output gate per head (`attention_output_gate`), per-head q/k
norms, rotary on a part of each head (`partial_rotary_factor`). Norms scale by (1 + weight)
in float32, but the mixer's gated norm. Qwen3.5-MoE has a sparse MLP in every layer: top-k
of a float32 softmax, always renormalised, and a gated shared expert.

Qwen3.5's rotary is M-RoPE (`mrope_section`): image tokens get a position per section; text
tokens get the same position in every section, where M-RoPE is plain rotary, and the worker
serves text. `*ForConditionalGeneration` checkpoints load their text model (the vision tower
is not used). transformers loads no multi-token-prediction layers (`mtp_num_hidden_layers`)
and neither does the worker; it logs that they are left out. Refused by name: layer types
other than full and linear attention, value heads not a multiple of key heads, and a
convolution activation other than SiLU (`read_linear_attention`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmserve.logs import get_logger
from worker_service.models.arch import (
    LINEAR_ATTENTION,
    LinearAttentionSpec,
    ModelArchConfig,
    MoeSpec,
    read_common,
    read_layer_kinds,
)
from worker_service.models.delta_net import DeltaNetWeights
from worker_service.models.family import Family
from worker_service.models.gemma import multimodal_text_config, multimodal_text_parts
from worker_service.models.rope import UnsupportedModelError
from worker_service.models.weights import (
    LayerWeights,
    MoeWeights,
    read_dense_mlp,
    read_layer,
    read_moe,
)

log = get_logger(__name__)

_LAYER_TYPES = ("full_attention", LINEAR_ATTENTION)

# (a linear_attn module, the model's spec) -> its fused input projection's rows
InProjReader = Callable[[Any, LinearAttentionSpec], torch.Tensor]


def read_linear_attention(config: Any) -> LinearAttentionSpec:
    """The Gated DeltaNet layers' shape, refusing what `delta_net` does not run."""
    if config.hidden_act != "silu":
        raise UnsupportedModelError(
            f"hidden_act {config.hidden_act!r} in linear-attention layers is not supported "
            f"(their convolution runs SiLU only)"
        )
    spec = LinearAttentionSpec(
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        k_dim=config.linear_key_head_dim,
        v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
    )
    if spec.num_v_heads % spec.num_k_heads:
        raise UnsupportedModelError(
            f"linear_num_value_heads {spec.num_v_heads} is not a multiple of "
            f"linear_num_key_heads {spec.num_k_heads}"
        )
    return spec


def hybrid_features(config: Any) -> dict[str, Any]:
    """What Qwen3.5 and Qwen3-Next share (see the module docstring)."""
    return dict(
        layers=read_layer_kinds(config, config.num_hidden_layers, supported=_LAYER_TYPES),
        linear_attention=read_linear_attention(config),
        norm="gemma",
        qk_norm="head",
        attention_output_gate=True,
    )


def read_dense_config(config: Any, architecture: str) -> ModelArchConfig:
    return read_common(config, architecture, **hybrid_features(config))


def read_moe_config(config: Any, architecture: str) -> ModelArchConfig:
    moe = MoeSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=True,
        round_weights=True,
        shared_expert_size=config.shared_expert_intermediate_size,
    )
    # No layer has a dense MLP: the model-wide width is the experts'.
    return read_common(
        config,
        architecture,
        intermediate_size=config.moe_intermediate_size,
        moe=moe,
        **hybrid_features(config),
    )


def read_hybrid_layer(
    layer: Any, arch: ModelArchConfig, index: int, read_in_proj: InProjReader
) -> LayerWeights:
    """A gated-attention or Gated DeltaNet layer, with a dense MLP or a sparse one with a
    shared expert; `read_in_proj` reads the mixer's input projections in the family's
    layout."""
    sparse = arch.moe is not None and index not in arch.moe.dense_layers
    moe = _read_sparse_block(layer.mlp) if sparse else None
    if not arch.layers[index].linear:
        return read_layer(layer, moe=moe, output_gate=True)
    spec = arch.linear_attention
    assert spec is not None
    mixer = layer.linear_attn
    return read_layer(layer, moe=moe, delta_net=read_delta_net(mixer, read_in_proj(mixer, spec)))


def read_delta_net(mixer: Any, in_proj: torch.Tensor) -> DeltaNetWeights:
    """A Gated DeltaNet module's weights, its input projections fused as `in_proj`."""
    conv = mixer.conv1d.weight.detach()[:, 0]  # [conv_dim, conv_kernel]
    bias = mixer.conv1d.bias
    return DeltaNetWeights(
        in_proj=in_proj,
        conv=conv.t().contiguous().t(),
        a_log=mixer.A_log.detach(),
        dt_bias=mixer.dt_bias.detach(),
        norm=mixer.norm.weight.detach(),
        out_proj=mixer.out_proj.weight.detach(),
        conv_bias=None if bias is None else bias.detach(),
    )


def _qwen3_5_in_proj(mixer: Any, spec: LinearAttentionSpec) -> torch.Tensor:
    """Qwen3.5 projects q/k/v, z, b and a apart, already in the mixer's order."""
    parts = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
    return torch.cat([p.weight.detach() for p in parts])


def _read_sparse_block(mlp: Any) -> MoeWeights:
    experts = read_moe(mlp, mlp.gate)
    shared = read_dense_mlp(mlp.shared_expert)
    experts.shared_gate_up = shared["gate_up"]
    experts.shared_down = shared["down"]
    experts.shared_gate = mlp.shared_expert_gate.weight.detach()
    return experts


def read_qwen3_5_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_hybrid_layer(layer, arch, index, _qwen3_5_in_proj)


def text_parts(hf_model: Any) -> tuple[Any, Any]:
    """The text model's modules (the causal-LM class's or the multimodal one's), logging
    the multi-token-prediction layers the checkpoint declares, which are not loaded."""
    config = multimodal_text_config(hf_model.config)
    layers = getattr(config, "mtp_num_hidden_layers", None)
    if layers:
        log.info("multi-token prediction layers are not loaded", mtp_layers=layers)
    return multimodal_text_parts(hf_model)


QWEN3_5 = Family(
    "qwen3_5",
    ("Qwen3_5ForCausalLM",),
    read_dense_config,
    read_qwen3_5_layer,
    text_parts=text_parts,
)
QWEN3_5_MULTIMODAL = Family(
    "qwen3_5",
    ("Qwen3_5ForConditionalGeneration",),
    read_dense_config,
    read_qwen3_5_layer,
    text_config=multimodal_text_config,
    text_parts=text_parts,
)
QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM",),
    read_moe_config,
    read_qwen3_5_layer,
    text_parts=text_parts,
)
QWEN3_5_MOE_MULTIMODAL = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForConditionalGeneration",),
    read_moe_config,
    read_qwen3_5_layer,
    text_config=multimodal_text_config,
    text_parts=text_parts,
)
