"""The native whole-model decode step (kernels/cpu/decode.cpp) for the models it can run.

decode.cpp implements a Llama layer: RMSNorm with the weight applied after the cast, fused
q/k/v (optional bias), full rotary from one table, attention over every cached key with the
scale head_dim ** -0.5, SwiGLU, no soft-capping. A model with any other feature (the names
in `ModelArchConfig.plain_blockers`: q/k norms, Gemma norms, sliding windows, NoPE layers,
experts, multipliers...) is refused here by name and runs its decode steps on the per-layer
path, whose attention is the `cpu` backend's paged kernel: that is the documented fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cpu.decode import ArgmaxLogprobs, DecodeLayer, DecodeShape, DecodeStep
from worker_service.attention.base import AttentionMetadata
from worker_service.models.arch import ModelArchConfig
from worker_service.models.weights import LayerWeights


def _shape(arch: ModelArchConfig) -> DecodeShape:
    return DecodeShape(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        rms_norm_eps=arch.rms_norm_eps,
    )


def native_decode_unsupported_reason(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    layers: Sequence[LayerWeights] | None = None,
) -> str | None:
    """Why the native decode step (and the native linear kernel, which shares its shape
    rules) cannot run this model, or None."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    blockers = arch.plain_blockers()
    if blockers:
        return f"{arch.architecture} has {', '.join(blockers)} (a Llama layer only)"
    if layers is not None and any(w.has_extras for w in layers):
        return f"{arch.architecture} has projection biases beyond q/k/v (a Llama layer only)"
    return _shape(arch).unsupported_reason()


def native_linear_unsupported_reason(arch: ModelArchConfig, dtype: torch.dtype) -> str | None:
    """Why `linear_rows` cannot run every projection of this model, or None: shapes only."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    widths = {
        "hidden size": arch.hidden_size,
        "intermediate size": arch.intermediate_size,
        "query width": arch.num_heads * arch.head_dim,
    }
    odd = [f"{name} {value}" for name, value in widths.items() if value % 8]
    return f"{', '.join(odd)} not a multiple of 8" if odd else None


class NativeDecode:
    """Pure decode steps of up to `max_batch` tokens as one native call, on the weights in
    their plain layout, which it keeps even when the other steps' matmuls use prepacked
    copies (float32: twice the weight memory)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        embed: torch.Tensor,  # [vocab, hidden]
        layers: list[LayerWeights],  # plain [out, in] weights, before any packing
        final_norm: torch.Tensor,  # [hidden]
        lm_head: torch.Tensor,  # [vocab, hidden]
        cos: torch.Tensor,  # [max_positions, head_dim]
        sin: torch.Tensor,  # [max_positions, head_dim]
        max_batch: int,
    ) -> None:
        plain = []
        for w in layers:
            assert w.input_norm is not None and w.post_norm is not None
            assert w.gate_up is not None and w.down is not None
            plain.append(
                DecodeLayer(w.input_norm, w.qkv, w.qkv_bias, w.o, w.post_norm, w.gate_up, w.down)
            )
        contiguous = [t.contiguous() for t in (embed, final_norm, lm_head, cos, sin)]
        self.step = DecodeStep(_shape(arch), plain, *contiguous)
        self.max_batch = max_batch

    def accepts(self, metadata: AttentionMetadata, logit_rows: torch.Tensor) -> bool:
        n = metadata.num_decodes
        return (
            metadata.num_prefills == 0
            and 0 < n <= self.max_batch
            and logit_rows.shape[0] == n  # every row samples, in order
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, ArgmaxLogprobs]:  # [n, vocab] logits
        self.step.bind_caches(kv_caches)
        return self.step.run(
            input_ids,
            positions,
            metadata.slot_mapping,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
        )
