"""Causal depthwise convolution with a state per sequence: torch references.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next) run their q/k/v projections through a short
causal convolution, one filter of `kernel_size` taps per channel, then SiLU. A sequence's
output at token t reads its inputs t - kernel_size + 1 .. t, so between calls it keeps its
last `kernel_size - 1` inputs: the conv state. States live in a pool, one slot per sequence,
that the caller indexes (`state_slots`); the functions read a slot and write it back.

Pool layout: `[num_slots, kernel_size - 1, dim]`, token-major like the inputs (row i is the
i-th oldest kept input), so a decode kernel reads and shifts whole rows. transformers keeps
`[batch, dim, kernel_size]` instead, whose oldest column no output reads.

Sequences are packed one after another (`query_start_loc`, as in `prefill_attention`), so
one call serves prefill chunks and decode tokens alike; `causal_conv1d_update` is the
one-token-per-sequence case that a decode kernel implements. Arithmetic is float32; outputs
and states are rounded to their tensors' dtypes.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from llmserve_kernels._checks import (
    FLOAT_DTYPES,
    KernelArgumentError,
    check_dim,
    check_dtype,
    check_has_initial_state,
    check_ndim,
    check_query_start_loc,
    check_same_dtype,
    check_state_slots,
)

Activation = Literal["silu"] | None


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, dim], sequences back to back
    conv_state: torch.Tensor,  # [num_slots, kernel_size - 1, dim], updated in place
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    state_slots: torch.Tensor,  # [num_seqs] int32
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    activation: Activation = "silu",
) -> torch.Tensor:  # [num_tokens, dim]
    """Each sequence's tokens convolved after the inputs its slot keeps (zeros where
    has_initial_state is False); its slot then keeps its last kernel_size - 1 inputs,
    old ones included when the sequence brought fewer. A sequence of no tokens keeps its
    slot as it was."""
    check_conv1d_args(x, conv_state, weight, bias, activation)
    starts = check_query_start_loc(query_start_loc, x.shape[0])
    slots = check_state_slots(state_slots, len(starts) - 1, conv_state.shape[0])
    initial = check_has_initial_state(has_initial_state, len(slots))
    out = torch.empty_like(x)
    for seq, slot in enumerate(slots):
        begin, end = starts[seq], starts[seq + 1]
        if begin == end:
            continue
        before = conv_state[slot].float()  # [kernel_size - 1, dim]
        if not initial[seq]:
            before = torch.zeros_like(before)
        inputs = torch.cat([before, x[begin:end].float()])  # [kernel_size - 1 + len, dim]
        out[begin:end] = _convolve(inputs, weight, bias, activation).to(out.dtype)
        conv_state[slot] = inputs[inputs.shape[0] - conv_state.shape[1] :].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [num_seqs, dim]: one token per sequence
    conv_state: torch.Tensor,  # [num_slots, kernel_size - 1, dim], updated in place
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    state_slots: torch.Tensor,  # [num_seqs] int32
    activation: Activation = "silu",
) -> torch.Tensor:  # [num_seqs, dim]
    """One decode token per sequence, every slot holding a state: the batch at once."""
    check_conv1d_args(x, conv_state, weight, bias, activation)
    slots = check_state_slots(state_slots, x.shape[0], conv_state.shape[0])
    index = torch.tensor(slots, dtype=torch.long, device=x.device)
    windows = torch.cat([conv_state[index].float(), x[:, None].float()], dim=1)
    # windows: [num_seqs, kernel_size, dim], oldest input first
    out = (windows * weight.float().t()).sum(dim=1)  # [num_seqs, dim]
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    conv_state[index] = windows[:, 1:].to(conv_state.dtype)
    return out.to(x.dtype)


def _convolve(
    inputs: torch.Tensor,  # [kernel_size - 1 + len, dim] float32, the kept inputs first
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    activation: Activation,
) -> torch.Tensor:  # [len, dim] float32
    windows = inputs.unfold(0, weight.shape[1], 1)  # [len, dim, kernel_size]
    out = (windows * weight.float()).sum(dim=-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out) if activation == "silu" else out


def check_conv1d_args(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Activation,
) -> None:
    """Validates a call's tensors (its offsets and slots are checked apart)."""
    check_ndim("x", x, 2, "[num_tokens, dim]")
    check_dtype("x", x, FLOAT_DTYPES)
    dim = x.shape[1]
    check_ndim("weight", weight, 2, "[dim, kernel_size]")
    check_dim("weight", weight, 0, dim, "dim")
    if weight.shape[1] < 2:
        raise KernelArgumentError(
            "weight", f"kernel_size must be at least 2, got {weight.shape[1]}"
        )
    check_ndim("conv_state", conv_state, 3, "[num_slots, kernel_size - 1, dim]")
    check_dim("conv_state", conv_state, 1, weight.shape[1] - 1, "kernel_size - 1")
    check_dim("conv_state", conv_state, 2, dim, "dim")
    check_same_dtype("conv_state", conv_state, x, "x")
    if bias is not None:
        check_ndim("bias", bias, 1, "[dim]")
        check_dim("bias", bias, 0, dim, "dim")
    if activation not in ("silu", None):
        raise KernelArgumentError("activation", f"expected 'silu' or None, got {activation!r}")
