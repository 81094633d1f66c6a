"""Paged attention with the native C++ kernels of `kernels.cpu`: the CPU backend.

Per layer: the step's keys/values go into their slots, then the prefill tokens (prompt chunks,
causal over their cached prefix) and the decode tokens each go through one kernel call that
reads K/V straight from the blocks and writes its rows of one output tensor. Unlike the
`torch` backend nothing is gathered into a padded copy, prefills of different lengths are not
padded to the longest, and a cached prefix costs no extra pass.

The kernels are compiled on first use; `auto` falls back to `torch` where they cannot be
built (no C++ compiler) or cannot run the model (dtype, head size).
"""

from __future__ import annotations

import torch

from kernels import cpu as cpu_kernels
from worker_service.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    register_backend,
)


@register_backend
class CpuAttentionBackend(AttentionBackend):
    """Native CPU paged attention (see the module docstring)."""

    name = "cpu"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        cpu_kernels.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        # query may be a row-strided view of the QKV projection: the kernels take its stride.
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            cpu_kernels.prefill_attention(
                query[:n_pre],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                self.scale,
                out=out[:n_pre],
            )
        if metadata.num_decodes:
            cpu_kernels.paged_attention_decode(
                query[n_pre:],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                self.scale,
                out=out[n_pre:],
            )
        return out

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"the native kernels run on the CPU only, not {spec.device}"
        reason = cpu_kernels.unsupported_reason(
            spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        if reason is not None:
            return f"unsupported model shape: {reason}"
        try:
            cpu_kernels.library()
        except cpu_kernels.NativeKernelUnavailable as exc:
            return str(exc)
        return None
