"""Paged attention with the Triton kernels of `llmserve_kernels/`: the CUDA backend.

Per layer: `reshape_and_cache` writes the step's keys/values into their slots, then the prefill
tokens (prompt chunks, causal over their cached prefix) go through `prefill_attention` and the
decode tokens through `paged_attention_decode`, each writing into its rows of one output tensor.
Both kernels read keys/values from the paged cache by block table, so nothing is gathered or
padded per step. The decode launch is planned once per step (`llmserve_kernels.DecodePlan`: checks,
partitioning, scratch, the compiled kernel) and only launched per layer. Sliding windows and
attention sinks (per layer) and soft-capping (per model) are arguments of both kernels.

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before this
module is imported); that is how the backend is tested without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

import llmserve_kernels
from llmserve_kernels.paged_attention import DecodePlan
from worker_service.attention.base import (
    AttentionMetadata,
    AttentionSpec,
    PagedKernelBackend,
    register_backend,
)


@register_backend
class TritonAttentionBackend(PagedKernelBackend):
    """Triton paged attention (see the module docstring)."""

    name = "triton"
    supports_sinks = True
    write_cache = staticmethod(llmserve_kernels.reshape_and_cache)
    prefill_attention = staticmethod(llmserve_kernels.prefill_attention)
    decode_attention = staticmethod(llmserve_kernels.paged_attention_decode)

    # The step's decode plan, made at its first decode layer (begin_step resets it).
    _plan: DecodePlan | None = None
    _plan_metadata: AttentionMetadata | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        # The plan is made at the step's first decode (layer 0), which brings the dtype.
        self._plan, self._plan_metadata = None, metadata

    def decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        out: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        metadata: AttentionMetadata,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if metadata is not self._plan_metadata:  # begin_step was not called for this step
            super().decode(query, key_cache, value_cache, out, metadata, extra)
            return
        # The soft-cap is the model's (self.softcap); only the window changes per layer.
        window = (extra or {}).get("sliding_window")
        sinks = (extra or {}).get("sinks")
        plan = self._plan
        if plan is None:
            plan = self._plan = DecodePlan(
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                block_size=metadata.block_size,
                dtype=query.dtype,
                scale=self.scale,
                max_seq_len=metadata.max_decode_seq_len,
                softcap=self.softcap,
            )
        plan.run(query, key_cache, value_cache, out, sliding_window=window, sinks=sinks)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec)
        if reason is not None:
            return reason
        if not llmserve_kernels.supports_device(spec.device):
            return f"the Triton kernels cannot run on {spec.device} (CPU needs TRITON_INTERPRET=1)"
        return None
