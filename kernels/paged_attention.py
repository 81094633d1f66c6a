"""Decode attention over the paged KV cache: one query token per sequence.

Cache layout (per layer): key and value `[num_blocks, block_size, num_kv_heads, head_dim]`;
token `t` of a sequence lives in block `block_tables[seq, t // block_size]` at offset
`t % block_size`.

One program handles (sequence, KV head, context partition). The query heads that share the KV
head are stacked into the rows of one tile, so every K/V row loaded from memory serves the whole
group (GQA), and the score and value products are matrix products on tensor cores. Decode is
memory-bound; the row padding of small groups costs compute, not bandwidth.

Long contexts are split into partitions of `partition_size` tokens (split-K) so that a small
batch still fills the device; each partition writes an unnormalized partial result with its
running max and sum, and `_paged_attention_reduce_kernel` merges them. Contexts that fit one
partition take a single pass that writes the output directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    KernelArgumentError,
    check_block_tables,
    check_device,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_ndim,
    check_out,
    check_paged_cache,
    check_seq_lens,
    is_interpreted,
    next_power_of_2,
)

DEFAULT_PARTITION_SIZE = 512
# Partitions are halved down to this size while the grid is too small to fill the device.
MIN_PARTITION_SIZE = 128
# Programs per streaming multiprocessor that the split-K grid aims for.
PROGRAMS_PER_SM = 2
# Context tokens per inner-loop step: K/V tiles of [TILE_TOKENS, head_dim].
MAX_TILE_TOKENS = 64
# tl.dot needs at least 16 rows on tensor cores; small GQA groups are padded up to it.
MIN_DOT_ROWS = 16
# Partitions merged per step of the reduction (bounds its register use for very long contexts).
REDUCE_CHUNK = 16
LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim] (single pass only)
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] fp32 (split only)
    max_logits_ptr,  # [num_seqs, num_heads, num_partitions] fp32, log2 domain (split only)
    exp_sums_ptr,  # [num_seqs, num_heads, num_partitions] fp32 (split only)
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_partitions,
    stride_os,
    stride_oh,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a power of 2 >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    num_tiles = tl.cdiv(tl.maximum(end - start, 0), TILE_TOKENS)

    rows = tl.arange(0, GROUP_ROWS)  # [GROUP_ROWS]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    heads = kv_head * QUERIES_PER_KV + rows  # [GROUP_ROWS]
    row_mask = rows < QUERIES_PER_KV
    dim_mask = dims < HEAD_DIM

    q_ptrs = query_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_ROWS, D]

    m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([GROUP_ROWS], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PAD], tl.float32)  # unnormalized output

    block_table_row = block_tables_ptr + seq * stride_bts
    for tile in range(0, num_tiles):
        tokens = start + tile * TILE_TOKENS + tl.arange(0, TILE_TOKENS)  # [TILE_TOKENS]
        token_mask = tokens < end
        blocks = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        blocks = blocks.to(tl.int64)
        offsets = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]

        k_rows = blocks * stride_kb + offsets * stride_kt + kv_head * stride_kh
        k = tl.load(key_cache_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(token_mask[None, :], scores, float("-inf"))  # [GROUP_ROWS, TILE]

        # Each tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = blocks * stride_vb + offsets * stride_vt + kv_head * stride_vh
        v = tl.load(value_cache_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        stats = (seq * num_heads + heads) * num_partitions + part  # [GROUP_ROWS]
        tl.store(max_logits_ptr + stats, m_i, mask=row_mask)
        tl.store(exp_sums_ptr + stats, l_i, mask=row_mask)
        partial_ptrs = partial_out_ptr + stats[:, None] * HEAD_DIM + dims[None, :]
        tl.store(partial_ptrs, acc, mask=out_mask)
    else:
        # An empty context (seq_len 0) yields zeros rather than NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_attention_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] fp32
    max_logits_ptr,  # [num_seqs, num_heads, num_partitions] fp32, log2 domain
    exp_sums_ptr,  # [num_seqs, num_heads, num_partitions] fp32
    seq_lens_ptr,  # [num_seqs] int32
    num_heads,
    num_partitions,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,  # num_partitions padded to a power of 2
    REDUCE_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Partitions past the end of this sequence were never written.
    used = tl.cdiv(seq_len, PARTITION_SIZE)
    stats_base = (seq * num_heads + head) * num_partitions

    parts = tl.arange(0, PARTITIONS_PAD)  # [PARTITIONS_PAD]
    part_mask = parts < used
    m = tl.load(max_logits_ptr + stats_base + parts, mask=part_mask, other=float("-inf"))
    l_part = tl.load(exp_sums_ptr + stats_base + parts, mask=part_mask, other=0.0)
    m_max = tl.max(m, 0)
    weights = tl.where(part_mask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(weights * l_part, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for chunk in range(0, tl.cdiv(used, REDUCE_CHUNK)):
        cparts = chunk * REDUCE_CHUNK + tl.arange(0, REDUCE_CHUNK)  # [REDUCE_CHUNK]
        cmask = cparts < used
        cm = tl.load(max_logits_ptr + stats_base + cparts, mask=cmask, other=float("-inf"))
        cw = tl.where(cmask, tl.exp2(cm - m_max), 0.0)
        partial_ptrs = partial_out_ptr + (stats_base + cparts)[:, None] * HEAD_DIM + dims[None, :]
        partial = tl.load(partial_ptrs, mask=cmask[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(cw[:, None] * partial, 0)

    out = acc / denom
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_partition_size(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Split-K partition length: 512 tokens, halved (down to 128) while the grid of
    (sequence, KV head, partition) programs is too small to keep every SM busy, which is the
    case for small batches of long contexts."""
    size = DEFAULT_PARTITION_SIZE
    if device.type != "cuda":
        return size
    target = PROGRAMS_PER_SM * _sm_count(device.index or 0)
    while size > MIN_PARTITION_SIZE and (
        num_seqs * num_kv_heads * triton.cdiv(max_context, size) < target
    ):
        size //= 2
    return size


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (Triton would otherwise use TF32 on tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    query: [num_seqs, num_heads, head_dim]; key_cache / value_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks_per_seq]
    int32; seq_lens: [num_seqs] int32, the context length including the query token (its K/V
    must already be in the cache). Returns out: [num_seqs, num_heads, head_dim].

    max_seq_len, when the caller knows it, bounds the split-K grid; otherwise the block-table
    width is used (no device sync). partition_size is the split-K partition length in tokens, a
    power of 2 (default: `choose_partition_size`); contexts within one partition take a single
    pass without the reduction.
    """
    check_ndim("query", query, 3, "[num_seqs, num_heads, head_dim]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_inner_contiguous("query", query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = check_paged_cache(key_cache, value_cache, query, "query")
    check_dim("key_cache", key_cache, 3, head_dim, "head_dim of query")
    if num_heads % num_kv_heads != 0:
        raise KernelArgumentError(
            "query", f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    check_block_tables(block_tables, num_seqs)
    check_seq_lens(seq_lens, num_seqs)
    out = check_out(out, query)
    if partition_size is not None and (
        partition_size <= 0 or partition_size & (partition_size - 1)
    ):
        raise KernelArgumentError("partition_size", f"{partition_size} is not a power of 2")
    check_device(
        _paged_attention_decode_kernel,
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "out": out,
        },
    )
    if num_seqs == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    if max_seq_len is not None:
        max_context = min(max_context, max_seq_len)
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_context, query.device)
    num_partitions = max(triton.cdiv(max_context, partition_size), 1)
    split = num_partitions > 1
    head_dim_pad = next_power_of_2(max(head_dim, 16))
    tile_tokens = min(MAX_TILE_TOKENS, partition_size)
    constants = dict(
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=next_power_of_2(max(queries_per_kv, MIN_DOT_ROWS)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_TOKENS=max(tile_tokens, 16),
        PARTITION_SIZE=partition_size,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    if split:
        stats_shape = (num_seqs, num_heads, num_partitions)
        max_logits = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
        exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
        partial_out = torch.empty(
            (*stats_shape, head_dim), dtype=torch.float32, device=query.device
        )
    else:
        max_logits = exp_sums = partial_out = out  # unused by the single-pass variant

    _paged_attention_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        partial_out,
        max_logits,
        exp_sums,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale * LOG2E,
        num_heads,
        num_partitions,
        out.stride(0),
        out.stride(1),
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        SPLIT=split,
        num_warps=4,
        **constants,
    )
    if split:
        _paged_attention_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            max_logits,
            exp_sums,
            seq_lens,
            num_heads,
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition_size,
            PARTITIONS_PAD=next_power_of_2(num_partitions),
            REDUCE_CHUNK=REDUCE_CHUNK,
            num_warps=4,
        )
    return out


def supports_device(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device` (CUDA, or anything interpreted)."""
    return device.type == "cuda" or is_interpreted(_paged_attention_decode_kernel)
