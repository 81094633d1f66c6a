"""Factories for the linear-attention ops' tests: packed sequences and state pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def offsets(lens: list[int]) -> torch.Tensor:  # [len(lens) + 1] int32
    """query_start_loc of sequences of these lengths packed one after another."""
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    return torch.tensor(starts, dtype=torch.int32)


def slots(values: list[int]) -> torch.Tensor:  # [len(values)] int32
    return torch.tensor(values, dtype=torch.int32)


@dataclass
class DeltaInputs:
    """One call's packed inputs of the gated delta rule."""

    q: torch.Tensor  # [num_tokens, num_k_heads, k_dim]
    k: torch.Tensor  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor  # [num_tokens, num_v_heads]
    beta: torch.Tensor  # [num_tokens, num_v_heads]

    def rows(self, begin: int, end: int) -> DeltaInputs:
        return DeltaInputs(*(x[begin:end] for x in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.g, self.beta)


def make_delta_inputs(
    num_tokens: int,
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> DeltaInputs:
    """Random inputs with decays as a trained layer makes them: g in (-1.5, 0), beta in (0, 1)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q = randn(num_tokens, num_k_heads, k_dim).to(dtype)
    k = randn(num_tokens, num_k_heads, k_dim).to(dtype)
    v = randn(num_tokens, num_v_heads, v_dim).to(dtype)
    g = -1.5 * torch.rand(num_tokens, num_v_heads, generator=generator)
    beta = torch.rand(num_tokens, num_v_heads, generator=generator)
    return DeltaInputs(q, k, v, g, beta)


def make_state_pool(
    num_slots: int, *inner: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:  # [num_slots, *inner]
    """A pool of states of moderate size (what a layer carries after some tokens)."""
    return (0.3 * torch.randn(num_slots, *inner, generator=generator)).to(dtype)


def delta_args(**change: object) -> dict[str, object]:
    """A valid call of the delta rule's prefill (two sequences, slots 0 and 3 of 4), changed."""
    gen = torch.Generator().manual_seed(0)
    inputs = make_delta_inputs(6, 2, 4, 16, 8, gen)
    args: dict[str, object] = dict(
        q=inputs.q,
        k=inputs.k,
        v=inputs.v,
        g=inputs.g,
        beta=inputs.beta,
        state=make_state_pool(4, 4, 16, 8, generator=gen),
        query_start_loc=offsets([4, 2]),
        state_slots=slots([0, 3]),
        has_initial_state=None,
    )
    return {**args, **change}
