"""Paged attention in plain torch: the CPU backend and the reference the others test against.

Prefills (query length > 1) run as one padded SDPA call over `[num_prefills, max_query_len]`
queries; when some prefill attends to a cached prefix its keys are gathered from the cache by
block table, otherwise the step's own keys are used directly. Decodes gather each sequence's
keys/values by block table into `[num_decodes, max_seq_len]` and run one SDPA call with GQA.
Index tensors and masks are built once per step in `begin_step` and shared by all layers
(a sliding window's masks once per step and window). With soft-capping the scores are
computed explicitly (matmul, scale, cap * tanh(s / cap), mask, float32 softmax), as the
transformers reference does, since SDPA cannot cap them; so are they with attention sinks
(gpt-oss): each head's sink logit joins the softmax as one more column, which is dropped
before the values are summed.

A layer's cache may be a view whose blocks lie further apart than a block (into a block-major
pool of all layers): slots are then rows of a flat view over its blocks and what lies between
them (`cache_rows`), or, where no such view exists, (block, offset) pairs. Either index is
made once per step and layout, as every layer of a pool shares its layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionBackend, AttentionMetadata, register_backend


def cache_rows(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> tuple[torch.Tensor, int] | None:
    """The cache as a view of rows [rows, num_kv_heads, head_dim] in which slot
    (block, offset) is row block * rows_per_block + offset, and rows_per_block; None when its
    blocks are not dense or lie no whole number of rows apart. A contiguous cache's rows are
    its slots; a view into a pool has the pool's other rows between its blocks, which no row
    of its slots reaches."""
    num_blocks, block_size, heads, dim = cache.shape
    if cache.is_contiguous():
        return cache.view(-1, heads, dim), block_size
    row, stride = heads * dim, cache.stride(0)
    if not num_blocks or not cache[0].is_contiguous() or stride % row or stride < block_size * row:
        return None
    per_block = stride // row
    rows = (num_blocks - 1) * per_block + block_size
    return cache.as_strided((rows, heads, dim), (row, dim, 1)), per_block


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
    supports_sinks = True
    # The current layer's sink logits ([num_heads]), set by `forward` for `_attend`.
    _sinks: torch.Tensor | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        device = metadata.slot_mapping.device
        slots = metadata.slot_mapping
        self._write_keep = None if bool((slots >= 0).all()) else slots >= 0
        # Flat slots per use ("write", "prefill", "decode"), and their indices into caches
        # whose blocks lie further apart (`_rows`, `_block_offsets`).
        self._slots = {"write": slots if self._write_keep is None else slots[self._write_keep]}
        self._row_index: dict[tuple[str, int], torch.Tensor] = {}
        self._block_index: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
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
                self._slots["prefill"] = self._prefill_slots
            keys = torch.arange(key_len, device=device)
            # Query i of a sequence sits at position context + i and sees key j iff
            # j <= context + i (causal over the prefix). Padded query rows still see key 0
            # (and with a window, keys near their padded position), so no row is empty.
            self._prefill_query_pos = context[:, None] + offsets[None, :]  # [num_prefills, q_max]
            self._prefill_keys = keys
            allowed = keys[None, None, :] <= self._prefill_query_pos[:, :, None]
            self._prefill_mask = allowed[:, None]  # [num_prefills, 1, q_max, key_len]
        if metadata.num_decodes:
            seq_max = metadata.max_decode_seq_len
            self._slots["decode"] = _slot_index(
                metadata.decode_block_tables, metadata.block_size, seq_max
            )
            keys = torch.arange(seq_max, device=device)
            mask = keys[None, :] < metadata.decode_seq_lens[:, None]
            self._decode_mask = mask[:, None, None, :]  # [num_decodes, 1, 1, seq_max]
            self._decode_keys = keys
            self._decode_seq_lens = metadata.decode_seq_lens
        self._window_masks: dict[tuple[str, int], torch.Tensor] = {}

    def _prefill_window_mask(self, window: int) -> torch.Tensor:  # [P, 1, q_max, key_len]
        mask = self._window_masks.get(("prefill", window))
        if mask is None:
            recent = self._prefill_keys[None, None, :] > (
                self._prefill_query_pos[:, :, None] - window
            )
            mask = self._prefill_mask & recent[:, None]
            self._window_masks["prefill", window] = mask
        return mask

    def _decode_window_mask(self, window: int) -> torch.Tensor:  # [D, 1, 1, seq_max]
        mask = self._window_masks.get(("decode", window))
        if mask is None:
            recent = self._decode_keys[None, :] > (self._decode_seq_lens[:, None] - 1 - window)
            mask = self._decode_mask & recent[:, None, None, :]
            self._window_masks["decode", window] = mask
        return mask

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
        write_kv: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self._sinks = sinks
        if write_kv:
            if self._write_keep is not None:
                key, value = key[self._write_keep], value[self._write_keep]
            self._scatter(key_cache, key)
            self._scatter(value_cache, value)
        n_pre = metadata.num_prefill_tokens
        parts = []
        if metadata.num_prefills:
            parts.append(
                self._prefill(
                    query[:n_pre], key, value, key_cache, value_cache, metadata, sliding_window
                )
            )
        if metadata.num_decodes:
            parts.append(
                self._decode(query[n_pre:], key_cache, value_cache, metadata, sliding_window)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _prefill(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        window: int | None,
    ) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
        num_prefills, q_max = self._prefill_rows.shape
        q = query[self._prefill_rows]  # [num_prefills, q_max, num_heads, head_dim]
        if self._prefill_slots is None:
            k = key[self._prefill_rows]
            v = value[self._prefill_rows]
        else:
            k = self._gather(key_cache, "prefill")
            v = self._gather(value_cache, "prefill")
            k = k.view(num_prefills, -1, self.num_kv_heads, self.head_dim)
            v = v.view(num_prefills, -1, self.num_kv_heads, self.head_dim)
        # Without a cached prefix or window, padded keys sit after every real query: plain
        # causal masking is exact and lets the kernel skip the upper triangle.
        causal = self._prefill_slots is None and window is None
        mask = self._prefill_mask if window is None else self._prefill_window_mask(window)
        out = self._attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None if causal else mask
        )  # [num_prefills, num_heads, q_max, head_dim]
        return out.transpose(1, 2)[self._prefill_valid]

    def _attend(
        self,
        q: torch.Tensor,  # [batch, num_heads, queries, head_dim]
        k: torch.Tensor,  # [batch, num_kv_heads, keys, head_dim]
        v: torch.Tensor,  # [batch, num_kv_heads, keys, head_dim]
        mask: torch.Tensor | None,  # [batch, 1, queries, keys] bool; None = causal
    ) -> torch.Tensor:  # [batch, num_heads, queries, head_dim]
        gqa = self.num_heads != self.num_kv_heads
        if self.softcap is None and self._sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa
            )
        if gqa:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            n_q, n_k = scores.shape[-2:]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        if self._sinks is not None:
            return torch.matmul(self._sink_softmax(scores, self._sinks), v)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    @staticmethod
    def _sink_softmax(
        scores: torch.Tensor,  # [batch, num_heads, queries, keys], masked with -inf
        sinks: torch.Tensor,  # [num_heads]
    ) -> torch.Tensor:  # [batch, num_heads, queries, keys] in scores' dtype
        """Softmax over the keys and one more logit per head, the sink, whose share is
        dropped: in the reference's order (shift by the joint maximum, softmax, drop)."""
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        joint = torch.cat([scores, column], dim=-1)
        joint = joint - joint.amax(dim=-1, keepdim=True)
        return torch.softmax(joint, dim=-1, dtype=joint.dtype)[..., :-1]

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        window: int | None,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        num_decodes = query.shape[0]
        k = self._gather(key_cache, "decode")
        v = self._gather(value_cache, "decode")
        k = k.view(num_decodes, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(num_decodes, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        mask = self._decode_mask if window is None else self._decode_window_mask(window)
        out = self._attend(query[:, :, None, :], k, v, mask)  # [num_decodes, num_heads, 1, dim]
        return out[:, :, 0, :]

    # -- cache indexing (see the module docstring) ----------------------------------------------

    def _scatter(
        self,
        cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        values: torch.Tensor,  # [num_written, num_kv_heads, head_dim]
    ) -> None:
        """values[i] into the cache at the step's i-th written slot."""
        flat = cache_rows(cache)
        if flat is None:
            cache.index_put_(self._block_offsets("write", cache.shape[1]), values)
        else:
            rows, per_block = flat
            rows.index_copy_(0, self._rows("write", cache.shape[1], per_block), values)

    def _gather(
        self,
        cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        use: str,  # "prefill" | "decode"
    ) -> torch.Tensor:  # [num_slots, num_kv_heads, head_dim]
        flat = cache_rows(cache)
        if flat is None:
            return cache[self._block_offsets(use, cache.shape[1])]
        rows, per_block = flat
        return rows.index_select(0, self._rows(use, cache.shape[1], per_block))

    def _rows(self, use: str, block_size: int, per_block: int) -> torch.Tensor:
        """The rows (`cache_rows`) of the step's slots for `use`: the slots themselves when
        blocks lie back to back."""
        slots = self._slots[use]
        if per_block == block_size:
            return slots
        rows = self._row_index.get((use, per_block))
        if rows is None:
            rows = slots // block_size * per_block + slots % block_size
            self._row_index[use, per_block] = rows
        return rows

    def _block_offsets(self, use: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (blocks, offsets) of the step's slots for `use`."""
        pair = self._block_index.get(use)
        if pair is None:
            slots = self._slots[use]
            pair = self._block_index[use] = (slots // block_size, slots % block_size)
        return pair
