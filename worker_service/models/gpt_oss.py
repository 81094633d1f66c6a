"""gpt-oss: Llama-shaped layers with biased q/k/v/o projections, norms that apply their weight
in float32, attention sinks (a learned logit per head in every softmax's denominator),
sliding windows on alternate layers (`layer_types`), YaRN rotary, and a sparse MLP in every
layer: a biased router whose top-k logits are softmaxed, experts with biases and a clamped
SwiGLU, gate and up interleaved in the checkpoint (taken apart by `weights.read_moe`).
Checkpoints whose experts ship in MXFP4 are dequantized at load (`mxfp4`)."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, MoeSpec, read_common
from worker_service.models.family import Family
from worker_service.models.rope import UnsupportedModelError
from worker_service.models.weights import LayerWeights, read_layer, read_moe


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    limit = getattr(config, "swiglu_limit", None)
    if limit is None:
        raise UnsupportedModelError("gpt-oss without swiglu_limit is not supported")
    moe = MoeSpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        norm_topk_prob=False,  # the softmax over the top k sums to 1 already
        routing="topk_softmax",
        swiglu_limit=float(limit),
        swiglu_alpha=float(config.swiglu_alpha),
    )
    # The experts ignore hidden_act; the model has no dense MLP for it to name.
    return read_common(
        config, architecture, norm="rms_f32", moe=moe, attention_sinks=True, activation="silu"
    )


def read_gpt_oss_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_layer(layer, moe=read_moe(layer.mlp, layer.mlp.router, gate_up_interleaved=True))


FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), read_config, read_gpt_oss_layer)
