"""Paged attention in plain torch: the CPU backend and the reference the others test against.

Prefills (query length > 1) run as one padded SDPA call over `[num_prefills, max_query_len]`
queries; when some prefill attends to a cached prefix its keys are gathered from the cache by
block table, otherwise the step's own keys are used directly. Decodes gather each sequence's
keys/values by block table into `[num_decodes, max_seq_len]` and run one SDPA call with GQA.
Index tensors and masks are built once per step in `begin_step` and shared by all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionBackend, AttentionMetadata, register_backend


def write_to_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    all_valid: bool,
) -> None:
    """Store each token's key/value at its flat slot (`block * block_size + offset`)."""
    if not all_valid:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_shape = (-1, key_cache.shape[2], key_cache.shape[3])
    key_cache.view(flat_shape).index_copy_(0, slot_mapping, key)
    value_cache.view(flat_shape).index_copy_(0, slot_mapping, value)


def _slot_index(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    block_size: int,
    num_positions: int,
) -> torch.Tensor:  # [num_seqs * num_positions] int64
    """Flat cache slots of positions [0, num_positions) of every sequence."""
    positions = torch.arange(num_positions, device=block_tables.device)
    blocks = block_tables.long()[:, positions // block_size]
    return (blocks * block_size + positions % block_size).reshape(-1)


@register_backend
class TorchAttentionBackend(AttentionBackend):
    """Vectorized torch implementation (see the module docstring)."""

    name = "torch"

    def begin_step(self, metadata: AttentionMetadata) -> None:
        device = metadata.slot_mapping.device
        self._all_slots_valid = bool((metadata.slot_mapping >= 0).all())
        if metadata.num_prefills:
            q_max = metadata.max_prefill_query_len
            offsets = torch.arange(q_max, device=device)
            starts = metadata.prefill_query_start_loc[:-1].long()
            self._prefill_valid = offsets[None, :] < metadata.prefill_query_lens[:, None]
            # Padded query rows read token 0 (dropped afterwards).
            self._prefill_rows = torch.where(self._prefill_valid, starts[:, None] + offsets, 0)
            if metadata.prefill_no_context:
                key_len = q_max
                context = torch.zeros_like(metadata.prefill_context_lens)
                self._prefill_slots: torch.Tensor | None = None
            else:
                key_len = metadata.max_prefill_seq_len
                context = metadata.prefill_context_lens
                self._prefill_slots = _slot_index(
                    metadata.prefill_block_tables, metadata.block_size, key_len
                )
            keys = torch.arange(key_len, device=device)
            # Query i of a sequence sees key j iff j <= context + i (causal over the prefix).
            # Padded query rows still see key 0, so no row is fully masked.
            allowed = keys[None, None, :] <= (context[:, None, None] + offsets[None, :, None])
            self._prefill_mask = allowed[:, None]  # [num_prefills, 1, q_max, key_len]
        if metadata.num_decodes:
            seq_max = metadata.max_decode_seq_len
            self._decode_slots = _slot_index(
                metadata.decode_block_tables, metadata.block_size, seq_max
            )
            keys = torch.arange(seq_max, device=device)
            mask = keys[None, :] < metadata.decode_seq_lens[:, None]
            self._decode_mask = mask[:, None, None, :]  # [num_decodes, 1, 1, seq_max]

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_to_cache(
            key, value, key_cache, value_cache, metadata.slot_mapping, self._all_slots_valid
        )
        n_pre = metadata.num_prefill_tokens
        parts = []
        if metadata.num_prefills:
            parts.append(self._prefill(query[:n_pre], key, value, key_cache, value_cache, metadata))
        if metadata.num_decodes:
            parts.append(self._decode(query[n_pre:], key_cache, value_cache, metadata))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _prefill(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
        num_prefills, q_max = self._prefill_rows.shape
        q = query[self._prefill_rows]  # [num_prefills, q_max, num_heads, head_dim]
        if self._prefill_slots is None:
            k = key[self._prefill_rows]
            v = value[self._prefill_rows]
        else:
            flat = (-1, self.num_kv_heads, self.head_dim)
            k = key_cache.view(flat).index_select(0, self._prefill_slots)
            v = value_cache.view(flat).index_select(0, self._prefill_slots)
            k = k.view(num_prefills, -1, self.num_kv_heads, self.head_dim)
            v = v.view(num_prefills, -1, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            # Without a cached prefix, padded keys sit after every real query: plain causal
            # masking is exact and lets the kernel skip the upper triangle.
            attn_mask=None if self._prefill_slots is None else self._prefill_mask,
            is_causal=self._prefill_slots is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [num_prefills, num_heads, q_max, head_dim]
        return out.transpose(1, 2)[self._prefill_valid]

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        num_decodes = query.shape[0]
        flat = (-1, self.num_kv_heads, self.head_dim)
        k = key_cache.view(flat).index_select(0, self._decode_slots)
        v = value_cache.view(flat).index_select(0, self._decode_slots)
        k = k.view(num_decodes, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(num_decodes, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],
            k,
            v,
            attn_mask=self._decode_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [num_decodes, num_heads, 1, head_dim]
        return out[:, :, 0, :]
