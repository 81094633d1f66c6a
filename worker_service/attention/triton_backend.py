"""Paged attention with the Triton kernels of `kernels/`: the CUDA backend.

Per layer: `reshape_and_cache` writes the step's keys/values into their slots, then the prefill
tokens (prompt chunks, causal over their cached prefix) go through `prefill_attention` and the
decode tokens through `paged_attention_decode`, each writing into its rows of one output tensor.
Both kernels read keys/values from the paged cache by block table, so nothing is gathered or
padded per step.

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before this
module is imported); that is how the backend is tested without a GPU.
"""

from __future__ import annotations

import torch

import kernels
from worker_service.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    register_backend,
)


@register_backend
class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention (see the module docstring)."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kernels.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            kernels.prefill_attention(
                query[:n_pre],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                self.scale,
                out=out[:n_pre],
                max_query_len=metadata.max_prefill_query_len,
            )
        if metadata.num_decodes:
            kernels.paged_attention_decode(
                query[n_pre:],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                self.scale,
                out=out[n_pre:],
                max_seq_len=metadata.max_decode_seq_len,
            )
        return out

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if not kernels.supports_device(spec.device):
            return f"the Triton kernels cannot run on {spec.device} (CPU needs TRITON_INTERPRET=1)"
        return None
