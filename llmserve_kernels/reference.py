"""Plain torch references for the kernels, with the same signatures.

They favour clarity over speed (a Python loop per sequence) and compute softmax in fp32; tests
compare the Triton kernels against them. Cache layout as in llmserve_kernels/paged_attention.py:
`[num_blocks, block_size, num_kv_heads, head_dim]`, of any strides (they index by block and
offset).
"""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence as [length, num_kv_heads, head_dim]."""
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_table: [max_blocks_per_seq]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kv_heads, d]
    return blocks.flatten(0, 1)[:length]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal_offset: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query tokens at positions causal_offset + i over keys 0..causal_offset + i
    (with a sliding window w, only the keys after position causal_offset + i - w); with a
    soft-cap c, each scaled score s becomes c * tanh(s / c) before the softmax; with sinks,
    head h's softmax has one more logit, sinks[h], whose probability is dropped.

    query: [q_len, num_heads, head_dim]; key/value: [kv_len, num_kv_heads, head_dim];
    sinks: [num_heads]. Returns [q_len, num_heads, head_dim] in fp32.
    """
    q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)  # [kv_len, num_heads, head_dim]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [heads, q_len, kv_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = causal_offset + torch.arange(q_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]  # [q_len, kv_len]
    if sliding_window:
        hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for llmserve_kernels.paged_attention_decode (max_seq_len / partition_size are
    ignored): sliding_window (None or 0: every key), softcap (None: off) and sinks ([num_heads] or
    None) as in `attend`.

    query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks_per_seq]; seq_lens: [num_seqs].
    """
    if out is None:
        out = torch.empty_like(query)
    for seq, length in enumerate(seq_lens.tolist()):
        if length == 0:
            out[seq] = 0
            continue
        key = gather_context(key_cache, block_tables[seq], length)
        value = gather_context(value_cache, block_tables[seq], length)
        result = attend(
            query[seq : seq + 1], key, value, scale, length - 1, sliding_window, softcap, sinks
        )
        out[seq] = result[0].to(out.dtype)
    return out


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
    """Reference for llmserve_kernels.prefill_attention (max_query_len is ignored): sliding_window
    (None or 0: every earlier key), softcap (None: off) and sinks ([num_heads] or None) as
    in `attend`.

    query: [num_tokens, num_heads, head_dim]; query_start_loc: [num_seqs + 1];
    seq_lens: [num_seqs] (cached prefix + new tokens).
    """
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, length in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        key = gather_context(key_cache, block_tables[seq], length)
        value = gather_context(value_cache, block_tables[seq], length)
        context_len = length - (q_end - q_start)
        result = attend(
            query[q_start:q_end], key, value, scale, context_len, sliding_window, softcap, sinks
        )
        out[q_start:q_end] = result.to(out.dtype)
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference for llmserve_kernels.reshape_and_cache: write token i to slot slot_mapping[i] (< 0:
    skip).

    key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    """
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Reference for llmserve_kernels.copy_blocks: block dst := block src in every layer, per pair.

    key_caches / value_caches: one [num_blocks, block_size, num_kv_heads, head_dim] per layer;
    block_mapping: [num_pairs, 2] int64 of (src, dst).
    """
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]
