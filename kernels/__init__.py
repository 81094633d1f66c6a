"""Triton kernels for paged attention, each with a torch reference in kernels.reference.

KV cache layout per layer: key and value `[num_blocks, block_size, num_kv_heads, head_dim]`.
On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1`, set before
this package is imported).
"""

from kernels._checks import KernelArgumentError
from kernels.cache_ops import copy_blocks, reshape_and_cache
from kernels.paged_attention import paged_attention_decode, supports_device
from kernels.prefill_attention import prefill_attention

__all__ = [
    "KernelArgumentError",
    "copy_blocks",
    "paged_attention_decode",
    "prefill_attention",
    "reshape_and_cache",
    "supports_device",
]
