"""Per-layer inputs (Gemma 4): besides its embedding, each token brings a small vector for
every layer, which gates a residual branch after that layer's MLP.

The vectors (`per_layer_inputs`) mix two parts, each `arch.per_layer_input_size` (P) wide
per layer: the token's row of a second embedding table (times sqrt(P) rounded to the weight
dtype, like the main embedding's scale), and the token's main embedding projected to every
layer's P dims (times hidden ** -0.5) and RMS-normalized per layer; their sum is scaled by
1/sqrt(2). Layer i's branch (`per_layer_branch`) projects the residual stream down to P,
activates it, multiplies by the token's vector i, projects back up and normalizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.models.arch import ModelArchConfig
from worker_service.models.blocks import activate, embedding_multiplier, rms_norm
from worker_service.models.weights import LayerWeights

Linear = Callable[..., torch.Tensor]


@dataclass(slots=True)
class PerLayerInputWeights:
    """The model-level weights of the per-layer inputs (P = `arch.per_layer_input_size`)."""

    embed: torch.Tensor  # [vocab_size_per_layer_input, num_layers * P]
    projection: torch.Tensor  # [num_layers * P, hidden]
    norm: torch.Tensor  # [P]

    def tensors(self) -> list[torch.Tensor]:
        return [self.embed, self.projection, self.norm]


def per_layer_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int64
    embeds: torch.Tensor,  # [num_tokens, hidden], the scaled main embeddings
    w: PerLayerInputWeights,
    arch: ModelArchConfig,
    linear: Linear,
) -> torch.Tensor:  # [num_tokens, num_layers, P]
    size = arch.per_layer_input_size
    assert size is not None
    shape = (input_ids.shape[0], arch.num_layers, size)
    scale = embedding_multiplier(float(size) ** 0.5, True, w.embed.dtype)
    assert scale is not None
    by_id = F.embedding(input_ids, w.embed) * scale
    projected = linear(embeds, w.projection) * arch.hidden_size**-0.5
    projected = rms_norm(projected.view(shape), w.norm, arch.rms_norm_eps, arch.norm)
    return (projected + by_id.view(shape)) * 2**-0.5


def per_layer_branch(
    x: torch.Tensor,  # [num_tokens, hidden], the residual stream after the MLP
    layer_input: torch.Tensor,  # [num_tokens, P], this layer's per-layer inputs
    w: LayerWeights,
    arch: ModelArchConfig,
    linear: Linear,
) -> torch.Tensor:  # [num_tokens, hidden], to add to the residual stream
    assert w.per_layer_gate is not None and w.per_layer_proj is not None
    gated = activate(linear(x, w.per_layer_gate), arch.activation) * layer_input
    return rms_norm(linear(gated, w.per_layer_proj), w.per_layer_norm, arch.rms_norm_eps, arch.norm)
