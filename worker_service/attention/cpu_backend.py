"""Paged attention with the native C++ kernels of `llmserve_kernels.cpu`: the CPU backend.

Per layer: the step's keys/values go into their slots, then the prefill tokens (prompt chunks,
causal over their cached prefix) and the decode tokens each go through one kernel call that
reads K/V straight from the blocks and writes its rows of one output tensor. Unlike the
`torch` backend nothing is gathered into a padded copy, prefills of different lengths are not
padded to the longest, and a cached prefix costs no extra pass.

The kernels are compiled on first use; `auto` falls back to `torch` where they cannot be
built (no C++ compiler) or cannot run the model (dtype, head size).
"""

from __future__ import annotations

from functools import partial

from llmserve_kernels import cpu as cpu_kernels
from worker_service.attention.base import AttentionSpec, PagedKernelBackend, register_backend


@register_backend
class CpuAttentionBackend(PagedKernelBackend):
    """Native CPU paged attention (see the module docstring)."""

    name = "cpu"
    supports_sinks = True
    # Unchecked calls (the wrappers' argument checks cost time on each of 3-4 calls a layer:
    # bench/RESULTS.md, "Offline throughput"): the model runner builds the step's tables and
    # refuses block ids outside the cache, so slots and tables are in range; the query and
    # cache shapes are fixed at load.
    write_cache = staticmethod(partial(cpu_kernels.write_kv, check=False))
    prefill_attention = staticmethod(partial(cpu_kernels.prefill_attention, check=False))
    decode_attention = staticmethod(partial(cpu_kernels.paged_attention_decode, check=False))
    # A bfloat16 cache's rows on the kernels' threads (torch's casts wake its own threads,
    # which then spin on the cores the kernels' pool needs).
    cast_rows = staticmethod(partial(cpu_kernels.convert_rows, check=False))

    def take_bf16_prompt_dots(self) -> bool:
        self.bf16_prompt_dots = cpu_kernels.has_bf16_dots()
        return self.bf16_prompt_dots

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec)
        if reason is not None:
            return reason
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
