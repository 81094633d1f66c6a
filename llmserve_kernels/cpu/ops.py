"""Fused elementwise ops of the decoder (every family's norms, q/k norms, rotary, SiLU- and
GELU-and-multiply), and the sampler's per-row argmax / log-sum-exp.

Each replaces a chain of torch calls with one pass over memory and one call (see ops.cpp
for the rounding they keep). Tensors must be contiguous CPU float32 or bfloat16 tensors
(but for row-strided inputs where noted, and write_kv's caches, whose blocks may lie apart);
anything else raises `KernelArgumentError` naming the argument.
`check=False` skips those checks, for callers that validated their inputs once per step
(the model's decoder layers call these 4-5 times per layer).
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve_kernels._checks import KernelArgumentError, check_block_layout
from llmserve_kernels.cpu.attention import DTYPE_CODES
from llmserve_kernels.cpu.build import library

# ops.cpp's NormKind codes: how each family applies the norm weight (the model arch's
# `NormKind` names them).
NORM_KINDS: dict[str, int] = {"rms": 0, "rms_f32": 1, "gemma": 2}


def rms_norm(
    x: torch.Tensor,  # [n, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [n, hidden], updated in place: residual += x
    kind: str = "rms",
    check: bool = True,
) -> torch.Tensor:  # [n, hidden]: normalize(x, or residual + x when given), weighted by kind
    if check:
        _check("x", x, 2)
        _check("weight", weight, 1, like=x)
        if weight.shape[0] != x.shape[1]:
            raise KernelArgumentError("weight", f"size {weight.shape[0]} != hidden {x.shape[1]}")
        if residual is not None:
            _check("residual", residual, 2, like=x)
            if residual.shape != x.shape:
                raise KernelArgumentError("residual", f"shape {tuple(residual.shape)} != x's")
        _check_kind(kind)
    out = torch.empty_like(x)
    library().llmserve_norm(
        DTYPE_CODES[x.dtype],
        NORM_KINDS[kind],
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return out


def head_norm_(
    x: torch.Tensor,  # [n, row_width], rows may be strided: per row, the heads come first
    weight: torch.Tensor,  # [head_dim], shared by every head
    eps: float,
    num_heads: int,  # heads to normalize per row
    kind: str = "rms",
    check: bool = True,
) -> torch.Tensor:  # x, its heads [0, num_heads) normalized in place
    """The q/k norms: each head of width weight.shape[0] normalized on its own (one head as
    wide as all of them is a norm over the whole projection, OLMo 2's)."""
    head_dim = weight.shape[0]
    if check:
        _check("x", x, 2, strided_rows=True)
        _check("weight", weight, 1, like=x)
        if num_heads < 1 or num_heads * head_dim > x.shape[1]:
            raise KernelArgumentError(
                "x", f"{num_heads} heads of {head_dim} do not fit a row of {x.shape[1]}"
            )
        _check_kind(kind)
    library().llmserve_head_norm(
        DTYPE_CODES[x.dtype],
        NORM_KINDS[kind],
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        num_heads,
        head_dim,
        weight.data_ptr(),
        eps,
    )
    return x


def rotary_(
    qkv: torch.Tensor,  # [n, row_width]: per row, the heads to rotate come first
    positions: torch.Tensor,  # [n] int64
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    num_heads: int,  # heads to rotate per row (query heads + key heads)
    head_dim: int | None = None,  # the heads' width; rotary_dim (the default) or wider
    check: bool = True,
) -> torch.Tensor:  # qkv, rotated in place
    """Rotary embedding, in place, of the first rotary_dim dims of heads [0, num_heads) of
    every row, by its position (the rest of a wider head is left as it is)."""
    rotary_dim = cos.shape[1]
    head_dim = rotary_dim if head_dim is None else head_dim
    if check:
        _check("qkv", qkv, 2, strided_rows=True)
        _check("cos", cos, 2, like=qkv)
        _check("sin", sin, 2, like=qkv)
        if num_heads * head_dim > qkv.shape[1] or rotary_dim % 2 or rotary_dim > head_dim:
            raise KernelArgumentError(
                "qkv",
                f"{num_heads} heads of {head_dim} rotating {rotary_dim} dims do not fit a row "
                f"of {qkv.shape[1]}",
            )
        if positions.dtype != torch.int64 or positions.shape != (qkv.shape[0],):
            raise KernelArgumentError("positions", f"expected [{qkv.shape[0]}] int64")
        positions = positions.contiguous()
        check_positions(positions, cos.shape[0])
    library().llmserve_rotary(
        DTYPE_CODES[qkv.dtype],
        qkv.data_ptr(),
        qkv.stride(0),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        qkv.shape[0],
        num_heads,
        head_dim,
        rotary_dim,
    )
    return qkv


def check_positions(positions: torch.Tensor, num_positions: int) -> None:
    """Positions index the cos/sin tables: each must lie in [0, num_positions)."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_positions):
        raise KernelArgumentError("positions", f"must lie in [0, {num_positions})")


def silu_mul(
    gate_up: torch.Tensor,  # [n, 2 * intermediate]: gate, then up
    check: bool = True,
) -> torch.Tensor:  # [n, intermediate] = silu(gate) * up
    return _gated(library().llmserve_silu_mul, gate_up, check)


def gelu_tanh_mul(
    gate_up: torch.Tensor,  # [n, 2 * intermediate]: gate, then up
    check: bool = True,
) -> torch.Tensor:  # [n, intermediate] = gelu(gate, approximate="tanh") * up (GeGLU)
    return _gated(library().llmserve_gelu_tanh_mul, gate_up, check)


def _gated(entry: Any, gate_up: torch.Tensor, check: bool) -> torch.Tensor:
    if check:
        _check("gate_up", gate_up, 2)
        if gate_up.shape[1] % 2:
            raise KernelArgumentError("gate_up", f"width {gate_up.shape[1]} is not even")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    entry(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), *out.shape)
    return out


def write_kv(
    key: torch.Tensor,  # [n, num_kv_heads, head_dim], rows may be strided
    value: torch.Tensor,  # [n, num_kv_heads, head_dim], rows strided like key
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same
    slot_mapping: torch.Tensor,  # [n] int64 flat slots; negative = skip (padding)
    check: bool = True,
) -> None:
    """Store token i's key and value at flat slot slot_mapping[i] (block * block_size +
    offset) of the caches, whose blocks may lie further apart than a block (one stride for
    both: `check_block_layout`)."""
    if check:
        slot_mapping = slot_mapping.contiguous()
        _check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    library().llmserve_write_kv(
        DTYPE_CODES[key.dtype],
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.shape[1],
        key_cache.stride(0),
    )


def convert_rows(
    x: torch.Tensor,  # [rows, ...] float32 or bfloat16, each row's elements contiguous
    dtype: torch.dtype,  # the other of the two
    check: bool = True,
) -> torch.Tensor:  # [rows, ...] contiguous, in `dtype`
    """x in `dtype`, as `x.to(dtype)` gives it (float32 to bfloat16 rounds to nearest even),
    on the kernels' threads; x's rows may lie further apart than a row (a view into a fused
    QKV projection's rows)."""
    rows, cols = x.shape[0], x[0].numel() if x.shape[0] else 0
    if check:
        check_cpu_dtype("x", x)
        if dtype not in DTYPE_CODES or dtype == x.dtype:
            raise KernelArgumentError("dtype", f"the other of float32 and bfloat16, not {dtype}")
        if rows and not x[0].is_contiguous():
            raise KernelArgumentError("x", "each row's elements must be contiguous")
    out = torch.empty(x.shape, dtype=dtype)
    if rows:
        library().llmserve_convert_rows(
            DTYPE_CODES[x.dtype], DTYPE_CODES[dtype], x.data_ptr(), x.stride(0), rows, cols,
            out.data_ptr(),
        )  # fmt: skip
    return out


def _check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
            raise KernelArgumentError(name, f"expected [n, heads, dim] rows, got {tensor.stride()}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape != key_cache.shape or cache.shape[2:] != key.shape[1:]:
            raise KernelArgumentError(name, f"shape {tuple(cache.shape)} does not fit the keys")
        check_cpu_dtype(name, cache, like=key)
    check_block_layout(key_cache, value_cache)
    if value.shape != key.shape or value.stride() != key.stride() or value.dtype != key.dtype:
        raise KernelArgumentError("value", "must have the key's shape, strides and dtype")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise KernelArgumentError("slot_mapping", f"expected [{key.shape[0]}] int64")
    slots = key_cache.shape[0] * key_cache.shape[1]
    if key.shape[0] and int(slot_mapping.max()) >= slots:
        raise KernelArgumentError("slot_mapping", f"slots must be < {slots}")


def argmax_logsumexp(
    logits: torch.Tensor,  # [n, vocab] float32 or bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the first argmax ([n] int64), log-sum-exp and maximum ([n] float32 each)."""
    _check("logits", logits, 2)
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    top = torch.empty(logits.shape[0], dtype=torch.float32)
    if logits.shape[0] and logits.shape[1]:
        library().llmserve_argmax_logsumexp(
            DTYPE_CODES[logits.dtype],
            logits.data_ptr(),
            *logits.shape,
            argmax.data_ptr(),
            lse.data_ptr(),
            top.data_ptr(),
        )
    return argmax, lse, top


def masked_argmax(
    logits: torch.Tensor,  # [n, vocab] float32 or bfloat16
    refused: torch.Tensor,  # [n, vocab] bool: True where the row may not take the token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first index of the largest value `refused` leaves ([n] int64; -1 where it
    leaves none), and that value's rank in the whole row ([n] int64: 1 + how many values
    are larger)."""
    _check("logits", logits, 2)
    if refused.dtype != torch.bool or refused.shape != logits.shape:
        raise KernelArgumentError("refused", f"expected bool {tuple(logits.shape)}")
    if refused.device.type != "cpu" or not refused.is_contiguous():
        raise KernelArgumentError("refused", "must be a contiguous CPU tensor")
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    rank = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0] and logits.shape[1]:
        library().llmserve_masked_argmax(
            DTYPE_CODES[logits.dtype],
            logits.data_ptr(),
            refused.data_ptr(),
            *logits.shape,
            argmax.data_ptr(),
            rank.data_ptr(),
        )
    return argmax, rank


def check_cpu_dtype(name: str, tensor: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """On the CPU, in a dtype the kernels have (like's, when given)."""
    if tensor.device.type != "cpu":
        raise KernelArgumentError(name, f"must be on the CPU, got {tensor.device}")
    if tensor.dtype not in DTYPE_CODES:
        raise KernelArgumentError(name, f"dtype {tensor.dtype} not supported")
    if like is not None and tensor.dtype != like.dtype:
        raise KernelArgumentError(name, f"dtype {tensor.dtype} differs from {like.dtype}")


def _check_kind(kind: str) -> None:
    if kind not in NORM_KINDS:
        raise KernelArgumentError("kind", f"{kind!r} is not one of {', '.join(NORM_KINDS)}")


def _check(
    name: str,
    tensor: torch.Tensor,
    ndim: int,
    like: torch.Tensor | None = None,
    strided_rows: bool = False,  # rows may lie further apart than their width
) -> None:
    if tensor.dim() != ndim:
        raise KernelArgumentError(name, f"expected {ndim} dimensions, got {tuple(tensor.shape)}")
    check_cpu_dtype(name, tensor, like)
    dense = tensor.stride(-1) == 1 if strided_rows else tensor.is_contiguous()
    if not dense:
        raise KernelArgumentError(name, f"must be contiguous, got strides {tensor.stride()}")
