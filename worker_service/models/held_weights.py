"""What a decoder model holds, seen from outside its forward pass: the bytes of its weights
(the worker reports them), and its matmuls alone over a batch (a benchmark's reference)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from llmserve_kernels.cpu.quant import QuantWeight

if TYPE_CHECKING:
    from worker_service.models.decoder import DecoderModel

_NESTED = ("moe", "delta_net")  # LayerWeights fields that hold weights of their own


def weight_bytes(model: DecoderModel) -> int:
    """Bytes of the weights this model holds: every tensor it (or its native decode step,
    which may keep plain copies of packed weights) points to but the rotary tables, each
    storage once."""
    held: list[object] = [model.embed, model.final_norm, model.lm_head]
    if model.per_layer_input_weights is not None:
        held += model.per_layer_input_weights.tensors()
    for layer in model.layers:
        held += [getattr(layer, f.name) for f in fields(layer) if f.name not in _NESTED]
        if layer.moe is not None:
            held += layer.moe.tensors()
        if layer.delta_net is not None:
            held += layer.delta_net.tensors()
    if model.native_decode is not None:
        held += model.native_decode.step._tensors
    tables = {t.untyped_storage().data_ptr() for pair in model.rope_tables for t in pair}
    sizes: dict[int, int] = {}
    for weight in held:
        if isinstance(weight, QuantWeight):
            sizes[weight.data_ptr()] = weight.nbytes
        elif isinstance(weight, torch.Tensor):
            if weight.is_mkldnn:  # opaque packed layout: no storage to share
                sizes[id(weight)] = weight.numel() * weight.element_size()
            else:
                storage = weight.untyped_storage()
                if storage.data_ptr() not in tables:  # the step's rotary tables
                    sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def linear_layers_only(model: DecoderModel, num_tokens: int) -> None:
    """Run just the dense matmuls of one forward over `num_tokens` tokens (bench
    reference), with the model's own matmul implementation."""
    arch, linear = model.arch, model.linear

    def zeros(width: int) -> torch.Tensor:  # [num_tokens, width]
        return torch.zeros(num_tokens, width, dtype=model.dtype, device=model.device)

    x = zeros(arch.hidden_size)
    for i, weights in enumerate(model.layers):
        if weights.delta_net is not None:
            linear(x, weights.delta_net.in_proj)
            linear(zeros(weights.delta_net.out_proj.shape[1]), weights.delta_net.out_proj)
        else:
            linear(x, weights.qkv, weights.qkv_bias)
            linear(zeros(arch.num_heads * arch.layer_head_dim(i)), weights.o)
        if weights.gate_up is not None and weights.down is not None:
            linear(x, weights.gate_up)
            # Layers' MLPs may differ in width (Gemma 4's double-wide ones).
            linear(zeros(weights.down.shape[1]), weights.down)
    linear(x, model.lm_head)
