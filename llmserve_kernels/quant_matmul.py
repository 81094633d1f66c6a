"""Weight-only quantized matmul for GPUs (Triton): out = x @ dequantize(w).T (issue #27).

The weight is dequantized tile by tile inside the K loop, in registers, and never written out
whole. Formats (`QuantFormat`):
- int8: `qweight` [N, K] int8, `scales` [N, K / group] : w = q * scale;
- int4: `qweight` [N, K / 2] uint8, weight 2i in the low nibble of byte i and 2i + 1 in the
  high one, `scales` and `zeros` [N, K / group] : w = (q - zero) * scale;
- GGUF blocks as llmserve_kernels/cpu/quant.cpp lays them out, `qweight` [N, K / block weights *
  block bytes] uint8: Q8_0 (w = q * d), Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m), fp16
  d and m in each 32-weight block; Q4_K, 144-byte super-blocks of 256 weights: fp16 d and
  dmin, 12 bytes of 6-bit scales sc and mins m packed for 8 sub-blocks of 32, 128 bytes of
  nibbles (sub-block 2p in the low nibbles of bytes 32p..32p+31, 2p + 1 in the high ones):
  w = (d * sc) * q - dmin * m.

Scales (and GGUF blocks) are looked up per weight column (`k // group`), not per K tile, so
a group smaller than BLOCK_K (several scales in one tile) or larger (one scale over several
tiles) are both right: reading one scale per tile is how a kernel gets groups smaller than
its tile silently wrong. Small batches split K across programs (`split_k`): each writes a
float32 partial of the output and the partials are summed after, in a fixed order.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import triton
import triton.language as tl

from llmserve_kernels._checks import (
    FLOAT_DTYPES,
    KernelArgumentError,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_ndim,
)
from llmserve_kernels.paged_decode_kernels import dot_precision


class QuantFormat(IntEnum):
    INT8 = 0
    INT4 = 1
    Q8_0 = 2
    Q4_0 = 3
    Q4_1 = 4
    Q4_K = 5


GGUF_FORMATS = {  # (weights, bytes) per block
    QuantFormat.Q8_0: (32, 34),
    QuantFormat.Q4_0: (32, 18),
    QuantFormat.Q4_1: (32, 20),
    QuantFormat.Q4_K: (256, 144),
}


@triton.jit
def _half_at(ptr):
    """The fp16 stored little-endian at byte pointers `ptr` (any shape), as float32."""
    low = tl.load(ptr).to(tl.uint16)
    high = tl.load(ptr + 1).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k_weights(block, j):
    """Weight `j` (0..255) of the Q4_K super-blocks at byte pointers `block`, as float32.

    Sub-block s < 4 keeps its scale and min in the low 6 bits of packed bytes s and s + 4;
    s >= 4 keeps their low 4 bits in the nibbles of byte s + 4 and their high 2 bits in the
    top bits of bytes s - 4 and s (ggml's get_scale_min_k4)."""
    sub = j // 32
    packed = block + 4 + sub % 4
    a = tl.load(packed).to(tl.int32)  # byte s, or s - 4
    b = tl.load(packed + 4).to(tl.int32)  # byte s + 4, or s
    e = tl.load(packed + 8).to(tl.int32)  # byte s + 4 when s >= 4
    low = sub < 4
    scale = tl.where(low, a & 63, (e & 0xF) | ((a >> 6) << 4)).to(tl.float32)
    least = tl.where(low, b & 63, (e >> 4) | ((b >> 6) << 4)).to(tl.float32)
    byte = tl.load(block + 16 + (sub // 2) * 32 + j % 32).to(tl.int32)
    q = ((byte >> ((sub % 2) * 4)) & 0xF).to(tl.float32)
    return (_half_at(block) * scale) * q - _half_at(block + 2) * least


@triton.jit
def _weight_tile(
    w_ptr,
    scales_ptr,
    zeros_ptr,
    rows,  # [BLOCK_N] weight rows (output features)
    cols,  # [BLOCK_K] weight columns (input features)
    mask,  # [BLOCK_N, BLOCK_K]
    stride_w,
    stride_s,
    GROUP: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK_WEIGHTS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """The dequantized weights [BLOCK_N, BLOCK_K] in float32 (0 where masked)."""
    r = rows[:, None].to(tl.int64)
    c = cols[None, :]
    if FORMAT == 0:  # int8
        q = tl.load(w_ptr + r * stride_w + c, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scales_ptr + r * stride_s + c // GROUP, mask=mask, other=0.0)
        w = q * scale.to(tl.float32)
    elif FORMAT == 1:  # int4, two per byte
        byte = tl.load(w_ptr + r * stride_w + c // 2, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((c % 2) * 4)) & 0xF).to(tl.float32)
        scale = tl.load(scales_ptr + r * stride_s + c // GROUP, mask=mask, other=0.0)
        zero = tl.load(zeros_ptr + r * stride_s + c // GROUP, mask=mask, other=0.0)
        w = (q - zero.to(tl.float32)) * scale.to(tl.float32)
    else:  # GGUF blocks
        block = w_ptr + r * stride_w + (c // BLOCK_WEIGHTS) * BLOCK_BYTES  # [BLOCK_N, BLOCK_K]
        j = c % BLOCK_WEIGHTS
        safe = tl.where(mask, block, w_ptr)  # masked lanes read the first block
        if FORMAT == 5:  # Q4_K
            w = _q4_k_weights(safe, j)
        elif FORMAT == 2:  # Q8_0
            q = tl.load(safe + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
            w = q * _half_at(safe)
        else:
            d = _half_at(safe)
            first = 2 if FORMAT == 3 else 4
            byte = tl.load(safe + first + j % 16).to(tl.int32)
            q = ((byte >> ((j // 16) * 4)) & 0xF).to(tl.float32)
            if FORMAT == 3:  # Q4_0  # noqa: SIM108 (a compile-time branch)
                w = d * (q - 8.0)
            else:  # Q4_1
                w = d * q + _half_at(safe + 2)
        w = tl.where(mask, w, 0.0)
    return w


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,
    scales_ptr,
    zeros_ptr,
    partial_ptr,  # [SPLIT_K, M, N] float32
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    GROUP: tl.constexpr,
    FORMAT: tl.constexpr,
    BLOCK_WEIGHTS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        cols = k_begin + k0 + tl.arange(0, BLOCK_K)
        x_mask = (rows_m[:, None] < M) & (cols[None, :] < K)
        x = tl.load(
            x_ptr + rows_m[:, None].to(tl.int64) * stride_x + cols[None, :], mask=x_mask, other=0.0
        )
        w_mask = (rows_n[:, None] < N) & (cols[None, :] < K)
        w = _weight_tile(w_ptr, scales_ptr, zeros_ptr, rows_n, cols, w_mask, stride_w, stride_s,
                         GROUP, FORMAT, BLOCK_WEIGHTS, BLOCK_BYTES)  # fmt: skip
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    out = partial_ptr + (split * M + rows_m[:, None].to(tl.int64)) * N + rows_n[None, :]
    tl.store(out, acc, mask=(rows_m[:, None] < M) & (rows_n[None, :] < N))


def quant_matmul(
    x: torch.Tensor,  # [M, K] float32 / float16 / bfloat16
    qweight: torch.Tensor,  # see the module docstring, per format
    fmt: QuantFormat,
    scales: torch.Tensor | None = None,  # [N, K / group] (int8, int4)
    zeros: torch.Tensor | None = None,  # [N, K / group] (int4)
    group: int = 32,
    split_k: int | None = None,  # None: 4 for batches under 16 rows, else 1
    block_k: int = 64,
) -> torch.Tensor:  # [M, N] in x's dtype
    n, k = _check(x, qweight, fmt, scales, zeros, group, block_k)
    m = x.shape[0]
    if split_k is None:
        split_k = 4 if m < 16 else 1
    if split_k < 1:
        raise KernelArgumentError("split_k", f"must be positive, got {split_k}")
    per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    block_m = 16
    block_n = 32
    dummy = qweight  # an unused pointer argument
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    block_weights, block_bytes = GGUF_FORMATS.get(fmt, (1, 0))
    _quant_matmul_kernel[grid](
        x,
        qweight,
        dummy if scales is None else scales,
        dummy if zeros is None else zeros,
        partial,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        0 if scales is None else scales.stride(0),
        GROUP=group,
        FORMAT=int(fmt),
        BLOCK_WEIGHTS=block_weights,
        BLOCK_BYTES=block_bytes,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_PER_SPLIT=per_split,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return partial.sum(0).to(x.dtype)


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    fmt: QuantFormat,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    group: int,
    block_k: int,
) -> tuple[int, int]:
    """(N, K) after checking every argument against `fmt`."""
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    check_ndim("qweight", qweight, 2, "[N, packed K]")
    if not qweight.is_contiguous():
        raise KernelArgumentError("qweight", "must be contiguous")
    if block_k < 16 or block_k & (block_k - 1):
        raise KernelArgumentError("block_k", f"a power of two from 16, got {block_k}")
    n, k = qweight.shape[0], x.shape[1]
    tensors = {"x": x, "qweight": qweight}
    if fmt in GGUF_FORMATS:
        check_dtype("qweight", qweight, (torch.uint8,))
        weights, size = GGUF_FORMATS[fmt]
        if k % weights or qweight.shape[1] != k // weights * size:
            raise KernelArgumentError(
                "qweight", f"rows of {qweight.shape[1]} bytes do not hold {k} {fmt.name} weights"
            )
    else:
        packed = k if fmt == QuantFormat.INT8 else k // 2
        check_dtype(
            "qweight", qweight, (torch.int8,) if fmt == QuantFormat.INT8 else (torch.uint8,)
        )
        if qweight.shape[1] != packed or (fmt == QuantFormat.INT4 and k % 2):
            raise KernelArgumentError(
                "qweight", f"[N, {packed}] for K = {k}, got {tuple(qweight.shape)}"
            )
        if group < 1 or k % group:
            raise KernelArgumentError("group", f"{group} does not divide K = {k}")
        needed = {"scales": scales, **({"zeros": zeros} if fmt == QuantFormat.INT4 else {})}
        for name, t in needed.items():
            if t is None:
                raise KernelArgumentError(name, f"required by {fmt.name}")
            if tuple(t.shape) != (n, k // group) or not t.is_contiguous():
                raise KernelArgumentError(
                    name, f"expected contiguous [{n}, {k // group}], got {tuple(t.shape)}"
                )
            check_dtype(name, t, FLOAT_DTYPES)
            tensors[name] = t
    check_device(_quant_matmul_kernel, tensors)
    return n, k
