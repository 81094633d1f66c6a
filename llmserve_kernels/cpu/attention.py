"""Paged attention over the KV cache: decode and chunked/prefix-cached prefill.

Both wrappers take the same arguments as their Triton and reference counterparts in
`llmserve_kernels` and `llmserve_kernels.reference`. Storage may be float32 or bfloat16;
arithmetic is fp32.
Each cache block must be dense, but blocks may lie further apart than a block (a layer's
view into a block-major pool of all layers), one stride for both caches
(`check_block_layout`).
`check=False` skips the argument checks (their cost per call: bench/RESULTS.md, "Offline
throughput"): for callers that have validated a step's tables once, like the worker's `cpu`
backend. The kernels themselves do not bounds-check.
"""

from __future__ import annotations

import torch

from llmserve_kernels._checks import (
    KernelArgumentError,
    check_block_layout,
    check_dim,
    check_dtype,
    check_ndim,
    check_same_dtype,
    check_sinks,
    check_window_softcap,
)
from llmserve_kernels.cpu.build import isa, library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128, 256, 512)
MAX_GROUP = 16  # query heads per kv head


def unsupported_reason(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why these kernels cannot run a model of this shape, or None when they can."""
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} (supported: float32, bfloat16)"
    return unsupported_shape_reason(num_heads, num_kv_heads, head_dim)


def unsupported_shape_reason(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why these kernels cannot attend over heads of this shape in any dtype, or None."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (at most {MAX_GROUP} per kv head)"
    return None


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including the query token
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    check: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    **_: object,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Each sequence's single query token attends to its first seq_lens[i] cached tokens
    (the last `sliding_window` of them when given); scores soft-capped when `softcap`; head
    h's softmax denominator also holds exp(sinks[h]) when `sinks`."""
    if check:
        check_window_softcap(sliding_window, softcap)
        check_sinks(sinks, query.shape[1], query.device)
    sinks32 = _float32(sinks)
    if check:
        _check_common(query, key_cache, value_cache, block_tables)
        check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
        check_dim("seq_lens", seq_lens, 0, query.shape[0], "num_seqs")
        check_dim("block_tables", block_tables, 0, query.shape[0], "num_seqs")
        seq_lens = _int32(seq_lens)
        out = _output(query, out)
    elif out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs:
        status = library().llmserve_paged_decode(
            DTYPE_CODES[query.dtype],
            head_dim,
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            key_cache.shape[2],
            key_cache.shape[1],
            key_cache.stride(0),  # one block stride for both caches (checked)
            scale,
            0,  # kv heads per work item: the kernel picks (paged_attention.cpp, DecodeArgs)
            query.stride(0),
            sliding_window or 0,
            softcap or 0.0,
            None if sinks32 is None else sinks32.data_ptr(),
        )
        _check_status(status, query, key_cache)
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    check: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    bf16_dots: bool = False,
    **_: object,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Query tokens at positions seq_len - q_len .. seq_len - 1, causal over the cache (and
    within `sliding_window` positions when given); scores soft-capped when `softcap`; sinks
    as in `paged_attention_decode`. `bf16_dots`: the scores and the weighted sums of values
    as AVX512-BF16 dot products of operands rounded to bfloat16, where the CPU has them
    (`has_bf16_dots`; fp32 elsewhere): prefill_chunk.h."""
    if check:
        check_window_softcap(sliding_window, softcap)
        check_sinks(sinks, query.shape[1], query.device)
    sinks32 = _float32(sinks)
    num_seqs = block_tables.shape[0]
    if check:
        _check_common(query, key_cache, value_cache, block_tables)
        check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
        check_dim("query_start_loc", query_start_loc, 0, num_seqs + 1, "num_seqs + 1")
        check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
        check_dim("seq_lens", seq_lens, 0, num_seqs, "num_seqs")
        query_start_loc, seq_lens = _int32(query_start_loc), _int32(seq_lens)
        out = _output(query, out)
    elif out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if num_seqs and query.shape[0]:
        status = library().llmserve_paged_prefill(
            DTYPE_CODES[query.dtype],
            query.shape[2],
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            query.shape[1],
            key_cache.shape[2],
            key_cache.shape[1],
            key_cache.stride(0),  # one block stride for both caches (checked)
            scale,
            query.stride(0),
            sliding_window or 0,
            softcap or 0.0,
            None if sinks32 is None else sinks32.data_ptr(),
            int(bf16_dots),
        )
        _check_status(status, query, key_cache)
    return out


def has_bf16_dots() -> bool:
    """Whether `prefill_attention(bf16_dots=True)` takes the bfloat16 dot products here."""
    return "avx512bf16" in isa()


def _float32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as the kernels read them (float32, contiguous); kept alive by the caller
    for the call."""
    return None if sinks is None else sinks.to(torch.float32).contiguous()


# -- checks ----------------------------------------------------------------------------------


def _check_common(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_dtype("query", query, tuple(DTYPE_CODES))
    check_same_dtype("key_cache", key_cache, query, "query")
    check_same_dtype("value_cache", value_cache, query, "query")
    if value_cache.shape != key_cache.shape:
        raise KernelArgumentError(
            "value_cache", f"shape {tuple(value_cache.shape)} differs from key_cache's"
        )
    check_dim("key_cache", key_cache, 3, query.shape[2], "head_dim")
    reason = unsupported_reason(query.dtype, query.shape[1], key_cache.shape[2], query.shape[2])
    if reason is not None:
        raise KernelArgumentError("query", f"unsupported shape: {reason}")
    for name, tensor in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
    ):
        if tensor.device.type != "cpu":
            raise KernelArgumentError(name, f"must be on the CPU, got {tensor.device}")
    check_block_layout(key_cache, value_cache)
    # Query rows may be strided (views into the fused QKV projection); heads may not.
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        raise KernelArgumentError(
            "query", f"heads must be contiguous within a row, got strides {query.stride()}"
        )
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise KernelArgumentError(
            "block_tables", f"must be int32 with unit-stride rows, got {block_tables.dtype}"
        )


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.int32).contiguous()


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype)  # contiguous even for a view
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise KernelArgumentError(
            "out", f"expected a contiguous {tuple(query.shape)} {query.dtype} tensor"
        )
    return out


def _check_status(status: int, query: torch.Tensor, key_cache: torch.Tensor) -> None:
    if status != 0:  # unreachable after the checks above unless the two disagree
        raise KernelArgumentError(
            "query",
            f"no kernel for dtype {query.dtype}, head_dim {query.shape[2]}, "
            f"{query.shape[1]} heads over {key_cache.shape[2]} kv heads",
        )
