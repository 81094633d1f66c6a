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

import kernels
from worker_service.attention.base import AttentionSpec, PagedKernelBackend, register_backend


@register_backend
class TritonAttentionBackend(PagedKernelBackend):
    """Triton paged attention (see the module docstring)."""

    name = "triton"
    write_cache = staticmethod(kernels.reshape_and_cache)
    prefill_attention = staticmethod(kernels.prefill_attention)
    decode_attention = staticmethod(kernels.paged_attention_decode)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if not kernels.supports_device(spec.device):
            return f"the Triton kernels cannot run on {spec.device} (CPU needs TRITON_INTERPRET=1)"
        # Not implemented in the Triton kernels yet (the `torch` and `cpu` backends have them).
        if spec.sliding_window is not None:
            return f"sliding-window attention (window {spec.sliding_window}) is not implemented"
        if spec.softcap is not None:
            return f"attention logit soft-capping ({spec.softcap}) is not implemented"
        return None
