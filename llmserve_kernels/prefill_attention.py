"""Prefill attention over the paged KV cache: a varlen batch of chunks with cached prefixes.

Each sequence contributes `q_len` new query tokens at positions `seq_len - q_len .. seq_len - 1`;
the tokens before them (an earlier chunk of a chunked prefill, or a prefix-cache hit) and the
new tokens themselves are read from the paged cache, so `reshape_and_cache` must have written
the new K/V first. Attention is causal: the token at position p sees keys 0..p, or with a
sliding window only keys p - window < k <= p. A soft-cap turns each scaled score s into
cap * tanh(s / cap) before the softmax. Attention sinks (one logit per head, with no value)
join each row's softmax: its running maximum starts at the sink and its running sum at 1.

One program handles (query tile, sequence, KV head). Its rows are BLOCK_QUERIES new tokens times
the query heads of that KV head (row r is token r // GROUP_ROWS, head r % GROUP_ROWS), so each K/V
tile loaded serves the whole GQA group. Online softmax over key tiles of BLOCK_KEYS tokens, in
fp32, with the key loop stopping at the last position the tile's final token can see and, with
a window, starting at the key tile of the first position its first token can see.

Windows, soft-caps and sinks are compile-time variants (`USE_WINDOW`, `USE_SOFTCAP`,
`USE_SINKS`), tested under the
Triton interpreter only: their compiled code on a GPU is untested so far.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_kernels._checks import (
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
    check_sinks,
    check_window_softcap,
    next_power_of_2,
)
from llmserve_kernels.paged_decode_kernels import LOG2E, _soft_cap, dot_precision

# Rows of one query tile (new tokens x padded GQA group).
BLOCK_ROWS = 64
BLOCK_KEYS = 64


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    sinks_ptr,  # [num_heads] sink logits (read when USE_SINKS)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (read when USE_WINDOW)
    softcap,  # soft-cap * log2(e) (read when USE_SOFTCAP)
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a power of 2
    BLOCK_QUERIES: tl.constexpr,  # new tokens per tile; BLOCK_QUERIES * GROUP_ROWS rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    tile_first = q_tile * BLOCK_QUERIES

    rows = tl.arange(0, BLOCK_QUERIES * GROUP_ROWS)  # [ROWS]
    tokens = tile_first + rows // GROUP_ROWS  # [ROWS] index among this sequence's new tokens
    group = rows % GROUP_ROWS
    heads = kv_head * QUERIES_PER_KV + group  # [ROWS]
    row_mask = (tokens < q_len) & (group < QUERIES_PER_KV)
    positions = context_len + tokens  # [ROWS] absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    q_ptrs = query_ptr + (q_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh + dims
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [ROWS, D]

    m_i = tl.full([BLOCK_QUERIES * GROUP_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_QUERIES * GROUP_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_QUERIES * GROUP_ROWS, HEAD_DIM_PAD], tl.float32)
    if USE_SINKS:
        # log2 domain; the literal is log2(e) (compiled kernels read only constexpr globals).
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([BLOCK_QUERIES * GROUP_ROWS], 1.0, tl.float32)

    # Keys this tile can see: up to the position of its last token; none for an empty tile.
    kv_end = tl.minimum(seq_len, context_len + tile_first + BLOCK_QUERIES)
    kv_end = tl.where(tile_first < q_len, kv_end, 0)
    # With a window, key tiles wholly before the window of the tile's first token are skipped.
    first_key_tile = 0
    if USE_WINDOW:
        first_key_tile = tl.maximum(context_len + tile_first - window + 1, 0) // BLOCK_KEYS
    block_table_row = block_tables_ptr + seq * stride_bts
    for key_tile in range(first_key_tile, tl.cdiv(kv_end, BLOCK_KEYS)):
        keys = key_tile * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)  # [BLOCK_KEYS] positions
        key_mask = keys < kv_end
        blocks = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        blocks = blocks.to(tl.int64)
        offsets = keys % BLOCK_SIZE
        kv_mask = key_mask[:, None] & dim_mask[None, :]

        k_rows = blocks * stride_kb + offsets * stride_kt + kv_head * stride_kh
        k = tl.load(key_cache_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            scores = _soft_cap(scores, softcap)
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
        if USE_WINDOW:
            visible = visible & (keys[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))  # [ROWS, BLOCK_KEYS]

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = m_new
        if USE_WINDOW:
            # A row may see no key of this tile yet (its window starts later): its maximum
            # stays -inf, and 0 stands in so that alpha and p are 0 rather than NaN. Without a
            # window, key 0 is visible to every row and lies in the first tile.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = blocks * stride_vb + offsets * stride_vt + kv_head * stride_vh
        v = tl.load(value_cache_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + (q_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged context.

    query: [num_tokens, num_heads, head_dim], the new tokens of all sequences back to back;
    key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding
    the new tokens' K/V; block_tables: [num_seqs, max_blocks_per_seq] int32;
    query_start_loc: [num_seqs + 1] int32, sequence s owns query rows
    query_start_loc[s]:query_start_loc[s + 1]; seq_lens: [num_seqs] int32, total context per
    sequence (cached prefix + new tokens). Returns out: [num_tokens, num_heads, head_dim].

    max_query_len sizes the grid; pass it to avoid a device sync (it is computed otherwise).
    sliding_window (None or 0: every earlier key) limits each token to the last sliding_window
    keys up to its own; softcap (None: off) turns each scaled score s into
    softcap * tanh(s / softcap) before the softmax; sinks ([num_heads], None: none) adds
    exp(sinks[h]) to head h's softmax denominator.
    """
    window, softcap_value = check_window_softcap(sliding_window, softcap)
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_inner_contiguous("query", query)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = check_paged_cache(key_cache, value_cache, query, "query")
    check_dim("key_cache", key_cache, 3, head_dim, "head_dim of query")
    if num_heads % num_kv_heads != 0:
        raise KernelArgumentError(
            "query", f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_inner_contiguous("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    check_block_tables(block_tables, num_seqs)
    check_seq_lens(seq_lens, num_seqs)
    out = check_out(out, query)
    check_sinks(sinks, num_heads, query.device)
    check_device(
        _prefill_attention_kernel,
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_tables": block_tables,
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
            "out": out,
        },
    )
    if num_seqs <= 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    group_rows = next_power_of_2(queries_per_kv)
    block_queries = max(BLOCK_ROWS // group_rows, 1)
    grid = (triton.cdiv(max_query_len, block_queries), num_seqs, num_kv_heads)
    _prefill_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        seq_lens if sinks is None else sinks,  # any pointer when there are none
        scale * LOG2E,
        window,
        softcap_value * LOG2E,  # caps log2-domain scores as softcap caps scaled ones
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
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=group_rows,
        BLOCK_QUERIES=block_queries,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(max(head_dim, 16)),
        BLOCK_SIZE=block_size,
        BLOCK_KEYS=BLOCK_KEYS,
        DOT_PRECISION=dot_precision(query.dtype),
        USE_SOFTCAP=softcap_value > 0,
        USE_WINDOW=window > 0,
        USE_SINKS=sinks is not None,
        num_warps=4,
    )
    return out
