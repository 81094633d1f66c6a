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

from kernels import cpu as cpu_kernels
from worker_service.attention.base import AttentionSpec, PagedKernelBackend, register_backend


@register_backend
class CpuAttentionBackend(PagedKernelBackend):
    """Native CPU paged attention (see the module docstring)."""

    name = "cpu"
    write_cache = staticmethod(cpu_kernels.write_kv)
    prefill_attention = staticmethod(cpu_kernels.prefill_attention)
    decode_attention = staticmethod(cpu_kernels.paged_attention_decode)

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
