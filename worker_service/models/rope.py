"""Rotary position embeddings: inverse frequencies (default, linear, llama3, yarn, longrope,
proportional), partial rotary, and the cos/sin tables the decoder indexes by position."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this worker does not implement."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary table: base `theta`, scaling parameters (a transformers `rope_parameters`
    dict, or None), and how many leading dims of each head rotate (`rotary_dim`)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...]  # sorted items of the scaling dict (hashable)
    rotary_dim: int
    max_position_embeddings: int

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.scaling)

    @property
    def rope_type(self) -> str:
        params = self.params
        return str(params.get("rope_type", params.get("type", "default")))


def read_rope_spec(params: dict[str, Any], head_dim: int, config: Any) -> RopeSpec:
    """A `RopeSpec` from one rope-parameters dict; refuses unknown rope types by name."""
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if rope_type == "proportional":
        # The table spans every dim of a head; the factor zeroes frequencies instead
        # (`_proportional`), so the pairs stay (i, i + head_dim / 2) as in full rotary.
        factor = 1.0
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    return RopeSpec(
        theta=theta,
        scaling=frozen,
        rotary_dim=int(head_dim * float(factor or 1.0)),
        max_position_embeddings=config.max_position_embeddings,
    )


def inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """The inverse frequencies of default, linear and llama3 rotary (`head_dim`: the rotary
    dims). Yarn and longrope need more than this: see `cos_sin_for`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    params = rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, params)[0]
    if rope_type == "proportional":
        return _proportional(head_dim, theta, params)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported here; supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
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


def _proportional(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's global layers: the first partial_rotary_factor of the head's frequency
    pairs turn at the rates full rotary over `head_dim` gives them (exponents over the whole
    head, not over the rotated part), the rest do not turn (frequency 0: cos 1, sin 0);
    all divided by `factor`."""
    rotated = int(float(params.get("partial_rotary_factor") or 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim
    inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32)
    inv_freq[:rotated] = 1.0 / (theta**exponents)
    return inv_freq / float(params.get("factor", 1.0))


def _yarn(
    dim: int, theta: float, params: dict[str, Any], max_positions: int | None = None
) -> tuple[torch.Tensor, float]:  # [dim // 2] float32 inverse frequencies, attention factor
    """YaRN: interpolated (slowed by `factor`) frequencies below a band of rotations,
    extrapolated (kept) ones above it, a linear ramp between; cos/sin scaled by
    0.1 * ln(factor) + 1 unless the config names the attention factor."""
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or (max_positions or original) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast = params.get("beta_fast") or 32
    slow = params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    powers = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv_freq, float(attention)


def _longrope(
    dim: int, theta: float, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """LongRoPE: per-frequency factors, `short_factor` within the original context and
    `long_factor` beyond it, and cos/sin scaled by sqrt(1 + ln(factor) / ln(original))."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * theta**exponents)
    long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * theta**exponents)
    return short, long, float(attention), original


def cos_sin_for(
    spec: RopeSpec, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [max_positions, rotary_dim]
    """The cos/sin table of one rotary spec, in the model dtype.

    LongRoPE: transformers picks short or long factors for a whole forward by the longest
    sequence in it; here a position within the original context uses the short factors and
    one beyond it the long ones (as vLLM does), so outputs equal transformers' while every
    sequence stays within `original_max_position_embeddings`."""
    params = spec.params
    if spec.rope_type == "longrope":
        short, long, attention, original = _longrope(
            spec.rotary_dim, spec.theta, params, spec.max_position_embeddings
        )
        cos_s, sin_s = cos_sin_table(short, max_positions, dtype, device, attention)
        cos_l, sin_l = cos_sin_table(long, max_positions, dtype, device, attention)
        cos_s[original:], sin_s[original:] = cos_l[original:], sin_l[original:]
        return cos_s, sin_s
    if spec.rope_type == "yarn":
        inv_freq, attention = _yarn(
            spec.rotary_dim, spec.theta, params, spec.max_position_embeddings
        )
        return cos_sin_table(inv_freq, max_positions, dtype, device, attention)
    inv_freq = inverse_frequencies(spec.rotary_dim, spec.theta, params)
    return cos_sin_table(inv_freq, max_positions, dtype, device)


def cos_sin_table(
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [max_positions, rotary_dim]
    """cos/sin per position, computed in float32 then cast (as the reference does)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]
    sin: torch.Tensor,  # [num_tokens, 1, rotary_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rotate the first rotary_dim dims of every head (all of them unless partial)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
