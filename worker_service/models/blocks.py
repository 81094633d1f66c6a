"""The elementwise building blocks families differ in, in plain torch, each in the order of
operations (and dtypes) of its transformers reference, which keeps greedy output token-equal."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.models.arch import Activation, NormKind


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor | None,  # [dim]; None: a norm without weight (Gemma 4's values)
    eps: float,
    kind: NormKind = "rms",
) -> torch.Tensor:  # [..., dim] in x's dtype
    """Normalize in float32; apply the weight as the family does (see `arch.NormKind`)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return x32.to(x.dtype)
    if kind == "rms":
        return weight * x32.to(x.dtype)
    if kind == "rms_f32":
        return (weight * x32).to(x.dtype)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def activate(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh")


def gated_activation(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: gate, then up
    activation: Activation,
) -> torch.Tensor:  # [num_tokens, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return activate(gate, activation) * up


def clamped_swiglu(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: gate, then up
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [num_tokens, intermediate]
    """gpt-oss's expert activation: the gate clamped above at `limit`, up within +-`limit`,
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in the reference's order (divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap


def embedding_multiplier(
    embed_scale: float | None, round_to_dtype: bool, dtype: torch.dtype
) -> float | None:
    """The factor the embeddings are multiplied by: `embed_scale`, first rounded to the
    weight dtype where the family does (Gemma multiplies by a tensor of its dtype)."""
    if embed_scale is None or not round_to_dtype:
        return embed_scale
    return float(torch.tensor(embed_scale, dtype=torch.float64).to(dtype))
