"""Triton kernels for paged attention, each with a torch reference in llmserve_kernels.reference.

KV cache layout per layer: key and value `[num_blocks, block_size, num_kv_heads, head_dim]`.
On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1`, set before
this package is imported).

Triton is imported with the first kernel asked for, not with the package: a CPU worker imports
`llmserve_kernels.cpu` (the C++ kernels) and never loads Triton (whose native module, loaded and
never used, printed hundreds of nanobind leak lines at every worker exit).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve_kernels._checks import KernelArgumentError
    from llmserve_kernels.cache_ops import copy_blocks, reshape_and_cache
    from llmserve_kernels.paged_attention import paged_attention_decode, supports_device
    from llmserve_kernels.prefill_attention import prefill_attention

# name -> the module that defines it
_EXPORTS = {
    "KernelArgumentError": "llmserve_kernels._checks",
    "copy_blocks": "llmserve_kernels.cache_ops",
    "reshape_and_cache": "llmserve_kernels.cache_ops",
    "paged_attention_decode": "llmserve_kernels.paged_attention",
    "supports_device": "llmserve_kernels.paged_attention",
    "prefill_attention": "llmserve_kernels.prefill_attention",
}

__all__ = [
    "KernelArgumentError",
    "copy_blocks",
    "paged_attention_decode",
    "prefill_attention",
    "reshape_and_cache",
    "supports_device",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmserve_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


class _Package(types.ModuleType):
    """`llmserve_kernels.prefill_attention` is the function, as with an eager import: importing the
    submodule of the same name binds the submodule on its package, and this puts the
    function there instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
