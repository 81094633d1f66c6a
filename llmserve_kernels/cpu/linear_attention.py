"""A Gated DeltaNet layer's states on CPUs: decode steps (linear_attention.cpp) and packed
prefill sequences (linear_prefill.cpp).

Each takes the arguments of its torch reference plus `check`: `causal_conv1d_update` and
`gated_delta_rule_decode` those of `llmserve_kernels.causal_conv1d.causal_conv1d_update` and
`llmserve_kernels.gated_delta_rule.gated_delta_rule_decode`; `causal_conv1d` those of
`llmserve_kernels.causal_conv1d.causal_conv1d`; `gated_delta_rule_prefill` those of
`llmserve_kernels.gated_delta_rule.gated_delta_rule_chunked` but its chunk size (it runs token by
token). Activations may be float32 or bfloat16; the recurrent state pool must be float32 (it
accumulates over the whole sequence). `check=False` skips the argument checks, for callers
that validated a step once; the kernels themselves do not bounds-check.
"""

from __future__ import annotations

from typing import Literal

import torch

from llmserve_kernels._checks import (
    KernelArgumentError,
    check_has_initial_state,
    check_query_start_loc,
    check_state_slots,
    rows_dense,
)
from llmserve_kernels.causal_conv1d import Activation, check_conv1d_args
from llmserve_kernels.cpu.attention import DTYPE_CODES
from llmserve_kernels.cpu.build import library
from llmserve_kernels.cpu.ops import check_cpu_dtype
from llmserve_kernels.gated_delta_rule import check_delta_rule_args

MAX_HEAD_DIM = 512  # linear_attention.h's kMaxKeyDim and kMaxValueDim


def causal_conv1d_update(
    x: torch.Tensor,  # [num_seqs, dim]: one token per sequence
    conv_state: torch.Tensor,  # [num_slots, kernel_size - 1, dim], updated in place
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    state_slots: torch.Tensor,  # [num_seqs] int32 or int64
    activation: Activation = "silu",
    check: bool = True,
) -> torch.Tensor:  # [num_seqs, dim]
    """Each sequence's token convolved after the inputs its slot keeps; the slot shifts.

    The kernel reads the weight tap by tap: a `weight` that is the transposed view of a
    contiguous [kernel_size, dim] tensor is read as it is, any other is copied so first."""
    if check:
        check_conv1d_args(x, conv_state, weight, bias, activation)
        check_state_slots(state_slots, x.shape[0], conv_state.shape[0])
        _check_cpu("x", x)
        _check_cpu("conv_state", conv_state, like=x)
        _check_cpu("weight", weight, like=x, layout="any")
        if bias is not None:
            _check_cpu("bias", bias, like=x)
    slots = state_slots.to(torch.int64).contiguous()
    taps = weight.t().contiguous()  # [kernel_size, dim]
    out = torch.empty_like(x)
    status = library().llmserve_conv1d_update(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        conv_state.data_ptr(),
        taps.data_ptr(),
        None if bias is None else bias.data_ptr(),
        slots.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.shape[1],
        int(activation == "silu"),
        out.data_ptr(),
    )
    assert status == 0, f"llmserve_conv1d_update refused weight {tuple(weight.shape)}"
    return out


def gated_delta_rule_decode(
    q: torch.Tensor,  # [num_seqs, num_k_heads, k_dim]: one token per sequence, rows may be strided
    k: torch.Tensor,  # [num_seqs, num_k_heads, k_dim], rows may be strided
    v: torch.Tensor,  # [num_seqs, num_v_heads, v_dim], rows may be strided
    g: torch.Tensor,  # [num_seqs, num_v_heads]
    beta: torch.Tensor,  # [num_seqs, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim] float32, updated in place
    state_slots: torch.Tensor,  # [num_seqs] int32 or int64
    *,
    scale: float | None = None,  # None: k_dim ** -0.5
    qk_l2norm: bool = True,
    check: bool = True,
) -> torch.Tensor:  # [num_seqs, num_v_heads, v_dim]
    """One step of the gated delta rule for every sequence, its state read and written in
    its slot."""
    if check:
        check_delta_rule_args(q, k, v, g, beta, state)
        check_state_slots(state_slots, v.shape[0], state.shape[0])
        _check_native_delta(q, k, v, state)
    num_seqs, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    g32 = g.to(torch.float32).contiguous()
    beta32 = beta.to(torch.float32).contiguous()
    slots = state_slots.to(torch.int64).contiguous()
    out = torch.empty(num_seqs, num_v_heads, v_dim, dtype=v.dtype)
    status = library().llmserve_gated_delta_decode(
        DTYPE_CODES[q.dtype],
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g32.data_ptr(),
        beta32.data_ptr(),
        state.data_ptr(),
        slots.data_ptr(),
        num_seqs,
        num_k_heads,
        num_v_heads,
        k_dim,
        v_dim,
        k_dim**-0.5 if scale is None else scale,
        int(qk_l2norm),
        out.data_ptr(),
    )
    assert status == 0, (
        f"llmserve_gated_delta_decode refused heads {tuple(q.shape)}, {tuple(v.shape)}"
    )
    return out


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, dim], sequences back to back; rows may be strided
    conv_state: torch.Tensor,  # [num_slots, kernel_size - 1, dim], updated in place
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 or int64
    state_slots: torch.Tensor,  # [num_seqs] int32 or int64
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    activation: Activation = "silu",
    check: bool = True,
) -> torch.Tensor:  # [num_tokens, dim]
    """Each sequence's tokens convolved after the inputs its slot keeps (zeros where
    has_initial_state is False); the slot then keeps its last kernel_size - 1 inputs. The
    weight is read tap by tap, as `causal_conv1d_update` reads it."""
    if check:
        check_conv1d_args(x, conv_state, weight, bias, activation)
        starts = check_query_start_loc(query_start_loc, x.shape[0])
        check_state_slots(state_slots, len(starts) - 1, conv_state.shape[0])
        check_has_initial_state(has_initial_state, len(starts) - 1)
        _check_cpu("x", x, layout="rows")
        _check_cpu("conv_state", conv_state, like=x)
        _check_cpu("weight", weight, like=x, layout="any")
        if bias is not None:
            _check_cpu("bias", bias, like=x)
    offsets, slots, initial = _sequences(query_start_loc, state_slots, has_initial_state)
    taps = weight.t().contiguous()  # [kernel_size, dim]
    out = torch.empty(x.shape, dtype=x.dtype)
    status = library().llmserve_causal_conv1d(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        conv_state.data_ptr(),
        taps.data_ptr(),
        None if bias is None else bias.data_ptr(),
        offsets.data_ptr(),
        slots.data_ptr(),
        None if initial is None else initial.data_ptr(),
        slots.shape[0],
        x.shape[1],
        weight.shape[1],
        int(activation == "silu"),
        out.data_ptr(),
    )
    assert status == 0, f"llmserve_causal_conv1d refused weight {tuple(weight.shape)}"
    return out


def gated_delta_rule_prefill(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_dim], sequences back to back, rows may be strided
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_dim], rows may be strided
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_dim], rows may be strided
    g: torch.Tensor,  # [num_tokens, num_v_heads]: log of each token's decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim] float32, updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 or int64
    state_slots: torch.Tensor,  # [num_seqs] int32 or int64
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    *,
    scale: float | None = None,  # None: k_dim ** -0.5
    qk_l2norm: bool = True,
    check: bool = True,
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_dim]
    """The gated delta rule over each sequence from the state in its slot (zeros where
    has_initial_state is False), leaving the state after its last token there; a sequence
    of no tokens leaves its slot alone."""
    if check:
        check_delta_rule_args(q, k, v, g, beta, state)
        starts = check_query_start_loc(query_start_loc, q.shape[0])
        check_state_slots(state_slots, len(starts) - 1, state.shape[0])
        check_has_initial_state(has_initial_state, len(starts) - 1)
        _check_native_delta(q, k, v, state)
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    offsets, slots, initial = _sequences(query_start_loc, state_slots, has_initial_state)
    g32 = g.to(torch.float32).contiguous()
    beta32 = beta.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, num_v_heads, v_dim, dtype=v.dtype)
    status = library().llmserve_gated_delta_prefill(
        DTYPE_CODES[q.dtype],
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g32.data_ptr(),
        beta32.data_ptr(),
        state.data_ptr(),
        offsets.data_ptr(),
        slots.data_ptr(),
        None if initial is None else initial.data_ptr(),
        slots.shape[0],
        num_k_heads,
        num_v_heads,
        k_dim,
        v_dim,
        k_dim**-0.5 if scale is None else scale,
        int(qk_l2norm),
        out.data_ptr(),
    )
    assert status == 0, (
        f"llmserve_gated_delta_prefill refused heads {tuple(q.shape)}, {tuple(v.shape)}"
    )
    return out


def _sequences(
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    state_slots: torch.Tensor,  # [num_seqs]
    has_initial_state: torch.Tensor | None,  # [num_seqs] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed calls' offsets and slots as dense int64, the flags as dense bool bytes."""
    initial = None if has_initial_state is None else has_initial_state.contiguous()
    return (
        query_start_loc.to(torch.int64).contiguous(),
        state_slots.to(torch.int64).contiguous(),
        initial,
    )


def _check_native_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor
) -> None:
    """What the C++ delta rule asks beyond the reference: CPU tensors, a float32 state,
    dense rows, head dims it has room for."""
    _check_cpu("state", state)
    if state.dtype != torch.float32:
        raise KernelArgumentError("state", f"must be float32, got {state.dtype}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_cpu(name, tensor, layout="rows")
        if tensor.shape[2] > MAX_HEAD_DIM:
            raise KernelArgumentError(name, f"head dims above {MAX_HEAD_DIM} have no kernel")


def _check_cpu(
    name: str,
    tensor: torch.Tensor,
    like: torch.Tensor | None = None,
    layout: Literal["dense", "rows", "any"] = "dense",  # rows: dense but for the first dim
) -> None:
    """On the CPU, in a dtype the kernels have (like's, when given), laid out as asked."""
    check_cpu_dtype(name, tensor, like)
    if layout == "rows":
        dense = rows_dense(tensor)
    elif layout == "dense":
        dense = tensor.is_contiguous()
    else:
        dense = True
    if not dense:
        raise KernelArgumentError(name, f"must be dense, got strides {tensor.stride()}")
