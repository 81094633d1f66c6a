"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and cos/sin tables."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this worker does not implement."""


def inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope_scaling)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated linearly in 1/wavelength."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low) / (high - low)
    interpolated = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelength >= original_len / high) & (wavelength <= original_len / low)
    return torch.where(in_band, interpolated, slowed)


def cos_sin_table(
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [max_positions, head_dim]
    """cos/sin per position, computed in float32 then cast (as the reference does)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
