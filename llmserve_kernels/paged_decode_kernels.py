"""The Triton programs of paged decode attention; `llmserve_kernels.paged_attention` launches them
(layout, algorithm and the wrappers are described there). Also the pieces the prefill kernel
shares with them: the log2-domain soft-cap and the dot precision per dtype.

Sliding windows, soft-capping and attention sinks are compile-time switches (`USE_WINDOW`,
`USE_SOFTCAP`, `USE_SINKS`): the plain variant compiles without them. A sink is one more
logit in a head's softmax with no value: the first partition starts its running maximum at
the sink and its running sum at 1 (exp of the sink minus itself), so the single pass and the
split-K reduction both count it once. They are tested under the Triton interpreter only; their
compiled code on a GPU (and its speed) is untested so far.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (Triton would otherwise use TF32 on tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _soft_cap(scores, cap):
    """cap * tanh(scores / cap), elementwise. Scores in the log2 domain (scaled by log2(e))
    take cap * log2(e): the result is then the log2-domain value of the capped score.
    tanh from exp2 of -2|x|, which stays in (0, 1] (the interpreter has no libdevice tanh).
    The factor is -2 * LOG2E written out: compiled kernels read only constexpr globals (the
    interpreter reads any, so only a GPU run caught a plain float global here)."""
    x = scores / cap
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))
    tanh = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -tanh, tanh)


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
    sinks_ptr,  # [num_heads] sink logits (read when USE_SINKS)
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_partitions,
    window,  # sliding window in tokens (read when USE_WINDOW)
    softcap,  # soft-cap * log2(e) (read when USE_SOFTCAP)
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
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    if USE_WINDOW:
        # The query (position seq_len - 1) sees keys from seq_len - window on: the tiles start
        # there, so blocks before the window are never loaded, and a partition wholly before
        # it runs no tile and leaves empty statistics (max -inf, sum 0) for the reduction.
        start = tl.maximum(start, seq_len - window)
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
    if USE_SINKS:
        # The sink joins partition 0 only (log2 domain; the literal is log2(e), see _soft_cap).
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
        m_i = tl.where(part == 0, sink * 1.4426950408889634, m_i)
        l_i = tl.where(part == 0, 1.0, l_i)

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
        if USE_SOFTCAP:
            scores = _soft_cap(scores, softcap)
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
