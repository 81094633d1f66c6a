"""Native CPU kernels: paged attention and the decoder's fused elementwise ops, in C++.

`paged_attention.cpp` (decode) and `paged_prefill.cpp` (prefill over a cached prefix) read
K/V straight from the paged cache; `decode.cpp` runs a whole decode step; `ops.cpp` fuses
every family's norms, q/k norms, rotary embedding and gated activations;
`sampling_rows.cpp` has the sampler's row reductions (argmax and log-sum-exp; the best token a mask
allows); `quant.cpp` keeps weights in GGUF blocks (dequantization, the linear layer in exact mode;
fast mode's in `quant_fast.cpp` and `quant_interleaved.cpp`, `llmserve_kernels.cpu.quant`);
`linear_attention.cpp` steps a Gated DeltaNet layer's conv and recurrent states at decode,
`linear_prefill.cpp` runs them over packed prefill sequences.
`build.py` compiles them for this CPU on first use, and `isa.cpp` says for which instruction
sets (`build.isa()`).
"""

from llmserve_kernels.cpu.attention import (
    DTYPE_CODES,
    has_bf16_dots,
    paged_attention_decode,
    prefill_attention,
    unsupported_reason,
)
from llmserve_kernels.cpu.build import NativeKernelUnavailable, is_available, library
from llmserve_kernels.cpu.linear_attention import (
    causal_conv1d,
    causal_conv1d_update,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
)
from llmserve_kernels.cpu.ops import (
    argmax_logsumexp,
    convert_rows,
    gelu_tanh_mul,
    head_norm_,
    masked_argmax,
    rms_norm,
    rotary_,
    silu_mul,
    write_kv,
)

__all__ = [
    "DTYPE_CODES",
    "NativeKernelUnavailable",
    "argmax_logsumexp",
    "causal_conv1d",
    "causal_conv1d_update",
    "convert_rows",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gelu_tanh_mul",
    "has_bf16_dots",
    "head_norm_",
    "masked_argmax",
    "is_available",
    "library",
    "paged_attention_decode",
    "prefill_attention",
    "rms_norm",
    "rotary_",
    "silu_mul",
    "unsupported_reason",
    "write_kv",
]
