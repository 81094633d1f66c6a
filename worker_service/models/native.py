"""The native whole-model decode step (llmserve_kernels/cpu/decode.cpp) for the models it can run.

decode.cpp runs every dense family here: Llama-style layers, Qwen3 (per-head q/k norms),
Gemma 2 and 3 ((1 + w) norms in float32, four norms a layer, GeGLU, scaled embeddings,
query_pre_attn_scalar, soft-capped scores and logits, per-layer windows and rotary tables),
SmolLM3 (NoPE layers), Granite (multipliers), OLMo 2 and 3 (full-width q/k norms, output
norms only; OLMo 3 with per-layer windows and rotary tables) and Phi-3 (partial rotary,
longrope tables), each step with the per-layer path's rounding points. What it does not
run (`ModelArchConfig.native_blockers`) is refused here by name and decodes on the per-layer
path, whose attention is the `cpu` backend's paged kernel.

Mixture-of-experts models (Qwen3-MoE, Mixtral, gpt-oss, whose attention sinks decode.cpp
lacks too) stay on the per-layer path: decode.cpp has
no routed expert MLP (router, top-k, renormalised weights, one matmul per chosen expert), and
the expert MLP is a large share of their per-layer step, measured on the tiny test models at
context 256 (bench/native_decode.py, bench/RESULTS.md "Native decode step per family"):
27-39% for Qwen3-MoE and 61-66% for Mixtral at batch 1-16. A native step without it would
save only the rest, and the dense families came first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from llmserve_kernels.cpu.decode import ArgmaxLogprobs, DecodeLayer, DecodeShape, DecodeStep, Weight
from llmserve_kernels.cpu.quant import QuantMode
from worker_service.attention.base import AttentionMetadata
from worker_service.models.arch import ModelArchConfig
from worker_service.models.blocks import embedding_multiplier
from worker_service.models.weights import LayerWeights

# The native step's projections read each weight row once for every token, which beats
# oneDNN's prepacked matmuls on small batches but not on large ones, and the sooner the
# larger the model (bench/RESULTS.md, "Native decode step per family"). Models whose head
# holds more weights than LARGE_HEAD_WEIGHTS take the native step up to SMALL_NATIVE_BATCH
# sequences, others up to NATIVE_BATCH.
LARGE_HEAD_WEIGHTS = 64 * 2**20
SMALL_NATIVE_BATCH = 4
NATIVE_BATCH = 8
# Weights kept in GGUF blocks (models/gguf_weights.py) multiply with the same block kernels on
# both paths, so the native step saves the per-layer path's overhead, and past the rows where
# the per-layer path would dequantize it saves that too: it was the faster at every batch
# measured, to 256 sequences, in both quant modes (bench/RESULTS.md, "The native step at
# every batch on GGUF blocks").
BLOCKS_NATIVE_BATCH = 256


def default_native_max_batch(arch: ModelArchConfig, blocks: bool = False) -> int:
    """The worker's default `native_decode_max_batch` for this model, its weights dense or in
    blocks (see above)."""
    if blocks:
        return BLOCKS_NATIVE_BATCH
    if arch.vocab_size * arch.hidden_size > LARGE_HEAD_WEIGHTS:
        return SMALL_NATIVE_BATCH
    return NATIVE_BATCH


def _shape(
    arch: ModelArchConfig, dtype: torch.dtype, quant_mode: QuantMode = "exact"
) -> DecodeShape:
    return DecodeShape(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        rms_norm_eps=arch.rms_norm_eps,
        rotary_dim=arch.rope.rotary_dim,
        norm=arch.norm,
        qk_norm=arch.qk_norm,
        activation=arch.activation,
        attention_scale=arch.scale,
        embed_scale=embedding_multiplier(arch.embed_scale, arch.round_embed_scale, dtype),
        residual_scale=arch.residual_scale,
        attn_softcap=arch.attn_softcap,
        final_softcap=arch.final_softcap,
        logits_divisor=arch.logits_divisor,
        quant_mode=quant_mode,
    )


def native_decode_unsupported_reason(arch: ModelArchConfig, dtype: torch.dtype) -> str | None:
    """Why the native decode step (and the native linear kernel, which shares its shape
    rules) cannot run this model, or None."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    blockers = arch.native_blockers()
    if blockers:
        return f"{arch.architecture} has {', '.join(blockers)} (dense layers only)"
    return _shape(arch, dtype).unsupported_reason()


def native_linear_unsupported_reason(arch: ModelArchConfig, dtype: torch.dtype) -> str | None:
    """Why `linear_rows` cannot run every projection of this model, or None: shapes only."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    widths = {
        "hidden size": arch.hidden_size,
        "intermediate size": arch.intermediate_size,
        "query width": arch.num_heads * arch.head_dim,
    }
    if arch.linear_attention is not None:  # the mixer's output projection's input
        widths["linear-attention value width"] = arch.linear_attention.value_width
    odd = [f"{name} {value}" for name, value in widths.items() if value % 8]
    return f"{', '.join(odd)} not a multiple of 8" if odd else None


def _decode_layer(
    w: LayerWeights, window: int | None, rotation: tuple[torch.Tensor, torch.Tensor] | None
) -> DecodeLayer:
    assert w.gate_up is not None and w.down is not None, "a dense layer"
    assert w.qkv is not None and w.o is not None, "an attention layer"
    cos, sin = rotation if rotation is not None else (None, None)
    return DecodeLayer(
        input_norm=w.input_norm,
        qkv=w.qkv,
        qkv_bias=w.qkv_bias,
        o=w.o,
        post_norm=w.post_norm,
        gate_up=w.gate_up,
        down=w.down,
        o_bias=w.o_bias,
        gate_up_bias=w.gate_up_bias,
        down_bias=w.down_bias,
        q_norm=w.q_norm,
        k_norm=w.k_norm,
        attn_out_norm=w.attn_out_norm,
        mlp_out_norm=w.mlp_out_norm,
        cos=cos,
        sin=sin,
        sliding_window=window,
    )


class NativeDecode:
    """Pure decode steps of up to `max_batch` tokens as one native call, on the weights in
    their plain layout (or GGUF blocks, multiplied in `quant_mode`), which it keeps even when
    the other steps' matmuls use prepacked copies (float32: twice the weight memory)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        embed: Weight,  # [vocab, hidden]
        layers: list[LayerWeights],  # plain [out, in] weights, before any packing
        final_norm: torch.Tensor,  # [hidden]
        lm_head: Weight,  # [vocab, hidden]
        rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]],  # [max_positions, rotary_dim]
        max_batch: int,
        quant_mode: QuantMode = "exact",
    ) -> None:
        tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in rope_tables]
        plain = [
            _decode_layer(w, kind.sliding_window, None if kind.rope is None else tables[kind.rope])
            for w, kind in zip(layers, arch.layers, strict=True)
        ]
        shape = _shape(arch, final_norm.dtype, quant_mode)
        self.step = DecodeStep(
            shape, plain, _contiguous(embed), final_norm.contiguous(), _contiguous(lm_head)
        )
        self.max_batch = max_batch
        self._layer_groups: tuple[int, ...] | None = None

    def accepts(self, metadatas: list[AttentionMetadata], logit_rows: torch.Tensor) -> bool:
        """Whether it runs this step: decodes only, every row sampling."""
        metadata = metadatas[0]
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
        metadatas: list[AttentionMetadata],  # one per KV group
        layer_groups: tuple[int, ...],  # each layer's KV group
    ) -> tuple[torch.Tensor, ArgmaxLogprobs]:  # [n, vocab] logits
        metadata = metadatas[0]
        self.step.bind_caches(kv_caches)
        if len(metadatas) == 1:
            return self.step.run(
                input_ids,
                positions,
                metadata.slot_mapping,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
            )
        if self._layer_groups != layer_groups:
            self.step.bind_groups(layer_groups)
            self._layer_groups = layer_groups
        width = max(m.decode_block_tables.shape[1] for m in metadatas)
        tables = torch.stack(
            [
                F.pad(m.decode_block_tables, (0, width - m.decode_block_tables.shape[1]))
                for m in metadatas
            ]
        )  # [groups, n, width] int32
        slots = torch.stack([m.slot_mapping for m in metadatas])  # [groups, n] int64
        return self.step.run(input_ids, positions, slots, tables, metadata.decode_seq_lens)


def _contiguous(weight: Weight) -> Weight:
    return weight.contiguous() if isinstance(weight, torch.Tensor) else weight
