"""Decode attention over the paged KV cache: one query token per sequence.

Cache layout (per layer): key and value `[num_blocks, block_size, num_kv_heads, head_dim]`;
token `t` of a sequence lives in block `block_tables[seq, t // block_size]` at offset
`t % block_size`. The kernels take the caches' strides (head_dim unit-stride), so blocks may
lie further apart than a block: a layer's views into a block-major pool of all layers.

One program handles (sequence, KV head, context partition). The query heads that share the KV
head are stacked into the rows of one tile, so every K/V row loaded from memory serves the whole
group (GQA), and the score and value products are matrix products on tensor cores. Decode is
memory-bound; the row padding of small groups costs compute, not bandwidth.

Long contexts are split into partitions of `partition_size` tokens (split-K) so that a small
batch still fills the device; each partition writes an unnormalized partial result with its
running max and sum, and `_paged_attention_reduce_kernel` merges them. Contexts that fit one
partition take a single pass that writes the output directly.

A sliding window (the query at position p sees keys p - window < k <= p) starts each
partition's tiles at the window's first key, so blocks before it are never read; a partition
wholly before it does no work. A soft-cap turns each scaled score s into cap * tanh(s / cap)
before the softmax. Attention sinks (one logit per head, with no value) join the softmax's
denominator. All three are compile-time variants (llmserve_kernels.paged_decode_kernels), tested
under the Triton interpreter only: untested on a GPU so far. The launch plan lives in
llmserve_kernels.decode_plan.
"""

from __future__ import annotations

import torch

from llmserve_kernels._checks import (
    FLOAT_DTYPES,
    check_block_tables,
    check_dtype,
    check_ndim,
    check_seq_lens,
    is_interpreted,
)
from llmserve_kernels.decode_plan import DecodeLaunchConfig, DecodePlan, choose_partition_size
from llmserve_kernels.paged_decode_kernels import _paged_attention_decode_kernel

__all__ = [
    "DecodeLaunchConfig",
    "DecodePlan",
    "choose_partition_size",
    "paged_attention_decode",
    "supports_device",
]


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
    launch: DecodeLaunchConfig | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    query: [num_seqs, num_heads, head_dim]; key_cache / value_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks_per_seq]
    int32; seq_lens: [num_seqs] int32, the context length including the query token (its K/V
    must already be in the cache). Returns out: [num_seqs, num_heads, head_dim].

    max_seq_len, when the caller knows it, bounds the split-K grid; otherwise the block-table
    width is used (no device sync). partition_size is the split-K partition length in tokens, a
    power of 2 (default: `choose_partition_size`); contexts within one partition take a single
    pass without the reduction. launch overrides the kernel's launch configuration (tuning).
    sliding_window (None or 0: every key) limits the query to the last sliding_window keys
    (itself included); softcap (None: off) turns each scaled score s into
    softcap * tanh(s / softcap) before the softmax; sinks ([num_heads], None: none) adds
    exp(sinks[h]) to head h's softmax denominator.

    One call = `DecodePlan` + `DecodePlan.run`; callers that attend over the same sequences
    once per layer build the plan once (see `DecodePlan`).
    """
    check_ndim("query", query, 3, "[num_seqs, num_heads, head_dim]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_seqs, num_heads, head_dim = query.shape
    check_block_tables(block_tables, num_seqs)
    check_seq_lens(seq_lens, num_seqs)
    plan = DecodePlan(
        block_tables,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=key_cache.shape[2],
        head_dim=head_dim,
        block_size=key_cache.shape[1],
        dtype=query.dtype,
        scale=scale,
        max_seq_len=max_seq_len,
        partition_size=partition_size,
        launch=launch,
        softcap=softcap,
    )
    return plan.run(query, key_cache, value_cache, out, sliding_window=sliding_window, sinks=sinks)


def supports_device(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device` (CUDA, or anything interpreted)."""
    return device.type == "cuda" or is_interpreted(_paged_attention_decode_kernel)
