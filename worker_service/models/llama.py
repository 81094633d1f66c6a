"""A compact Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens.

Every linear layer runs once per step over all tokens of all sequences (`[num_tokens, ...]`),
q/k/v and gate/up are fused into one matmul each, and attention goes through an
`AttentionBackend` that reads and writes the paged KV cache. With `fused_ops` (the native CPU
backend) the elementwise steps between matmuls (residual add + RMSNorm, rotary, SiLU-and-
multiply) are single C++ calls from `kernels.cpu`. With `packed_linear` the weights are
reordered once, at load, into oneDNN's blocked layout and every matmul runs through oneDNN
(see `packed_linear_available`); with `native_linear` through `kernels.cpu.decode.linear_rows`,
which reads bfloat16 weights as they are (the choice where oneDNN cannot run bfloat16).
Weights are taken from a loaded `transformers` model; the elementwise arithmetic follows the reference order, so fp32 greedy output matches HF token
for token (packed fp32 matmuls sum in oneDNN's order, not MKL's: logits differ by ~1e-6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu import ops as cpu_ops
from kernels.cpu.decode import (
    ArgmaxLogprobs,
    DecodeLayer,
    DecodeShape,
    DecodeStep,
    linear_rows,
    set_num_threads,
)
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.models.rope import (
    UnsupportedModelError,
    apply_rotary,
    cos_sin_table,
    inverse_frequencies,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Rows the packed weights are laid out for: oneDNN picks its blocking by this hint; the packed
# weights serve any number of rows (measured here: packing for 64 runs 1-2048 rows as fast as
# packing for each size).
_PACKED_ROWS_HINT = 64


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN matmuls with prepacked weights can run: CPU, float32 or bfloat16.

    Measured on the 2-core AVX-512 CPU of bench/RESULTS.md, the 30 layers of SmolLM2 at 32
    rows take 41 ms instead of F.linear's 88 ms in float32 (F.linear goes to MKL there) and
    24 instead of 36 ms in bfloat16, where F.linear re-lays its weights out on every call.
    bfloat16 results are bit-identical to F.linear; float32 ones differ in summation order.

    oneDNN's bfloat16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
    it refuses to pack bfloat16 weights, so bfloat16 keeps F.linear there.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def packed_matmul(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # packed by torch.ops.mkldnn._reorder_linear_weight
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def native_matmul(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # [out, in], checked at load
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out]
    return linear_rows(x.contiguous(), weight, bias, check=False)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKED_ROWS_HINT)


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """The shape of a Llama-family model, read from a transformers config."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    # Mistral's sliding window (None = full attention); the worker caps max_model_len to it.
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: Any, class_name: str | None = None) -> ModelArchConfig:
        """`class_name`: the loaded model's class, for configs without `architectures` (GGUF)."""
        architectures = list(getattr(config, "architectures", None) or [class_name or ""])
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {architectures or config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"activation {config.hidden_act!r} is not supported (silu only)"
            )
        rope = dict(
            getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        )
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0) or 10000.0))
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        sliding = getattr(config, "sliding_window", None)
        if arch == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=theta,
            rope_scaling=rope or None,
            sliding_window=sliding,
        )


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    # Same arithmetic as the reference: normalize in float32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    """Forward pass of a Llama-family causal LM over the paged cache. Not an nn.Module: plain
    weight tensors keep per-layer Python overhead to a handful of calls."""

    def __init__(
        self,
        arch: ModelArchConfig,
        embed: torch.Tensor,  # [vocab, hidden]
        layers: list[LayerWeights],
        final_norm: torch.Tensor,  # [hidden]
        lm_head: torch.Tensor,  # [vocab, hidden]
        max_positions: int,
        fused_ops: bool = False,
        packed_linear: bool = False,
        native_linear: bool = False,
        native_decode_max_batch: int = 0,
    ) -> None:
        self.arch = arch
        # CPU only: RMSNorm, rotary and SiLU-and-multiply through kernels.cpu (see forward).
        self.fused_ops = fused_ops
        self.packed_linear = packed_linear
        self.linear: Callable[..., torch.Tensor] = F.linear
        inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.cos, self.sin = cos_sin_table(inv_freq, max_positions, embed.dtype, embed.device)
        # CPU only: pure decode steps of up to this many tokens run as one native call
        # (kernels/cpu/decode.cpp) on the weights in their plain layout, which it keeps even
        # when the other steps' matmuls use prepacked copies (float32: twice the weight memory).
        self.native_decode_max_batch = 0
        self.decode_step: DecodeStep | None = None
        # Each row's argmax and its logprob when the last forward ran the native decode step
        # (which finds them while the logits are in cache), else None.
        self.argmax_logprobs: ArgmaxLogprobs | None = None
        if fused_ops or native_decode_max_batch > 0 or native_linear:
            set_num_threads(torch.get_num_threads())  # the C++ kernels' own threads (pool.h)
        if native_decode_max_batch > 0:
            if not fused_ops:
                raise ValueError("the native decode step needs the native CPU ops (fused_ops)")
            self.decode_step = _native_decode_step(
                arch, embed, layers, final_norm, lm_head, self.cos, self.sin
            )
            self.native_decode_max_batch = native_decode_max_batch
        if packed_linear:
            if not packed_linear_available(embed.device, embed.dtype):
                raise ValueError(
                    f"packed linear layers need oneDNN on the CPU in float32 or bfloat16, "
                    f"not {embed.device} {embed.dtype}"
                )
            for w in layers:
                w.qkv, w.o, w.gate_up, w.down = map(pack_weight, (w.qkv, w.o, w.gate_up, w.down))
            lm_head = pack_weight(lm_head)  # a copy: the embedding (often the same tensor) stays
            self.linear = packed_matmul
        elif native_linear:
            reason = native_decode_unsupported_reason(arch, embed.dtype)
            if reason is not None or embed.device.type != "cpu":
                raise ValueError(f"native linear layers cannot run this model: {reason}")
            for w in layers:
                w.qkv, w.o, w.gate_up, w.down = (
                    t.contiguous() for t in (w.qkv, w.o, w.gate_up, w.down)
                )
            lm_head = lm_head.contiguous()
            self.linear = native_matmul
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        max_positions: int,
        fused_ops: bool = False,
        packed_linear: bool = False,
        native_linear: bool = False,
        native_decode_max_batch: int = 0,
    ) -> LlamaModel:
        """Take (fuse, not copy where possible) the weights of a transformers Llama-family model."""
        arch = ModelArchConfig.from_hf(hf_model.config, type(hf_model).__name__)
        inner = hf_model.model
        layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=torch.cat(
                        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
                    ).detach(),
                    qkv_bias=None if biases[0] is None else torch.cat(biases).detach(),
                    o=attn.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                    down=mlp.down_proj.weight.detach(),
                )
            )
        return cls(
            arch,
            embed=inner.embed_tokens.weight.detach(),
            layers=layers,
            final_norm=inner.norm.weight.detach(),
            lm_head=hf_model.lm_head.weight.detach(),
            max_positions=max_positions,
            fused_ops=fused_ops,
            packed_linear=packed_linear,
            native_linear=native_linear,
            native_decode_max_batch=native_decode_max_batch,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer K, V caches
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor,  # [num_logit_rows] int64, token rows that need logits
    ) -> torch.Tensor:  # [num_logit_rows, vocab] in the model dtype (the sampler upcasts)
        num_tokens = input_ids.shape[0]
        linear = self.linear
        self.argmax_logprobs = None
        if self.fused_ops:  # the native ops below run unchecked: validate their inputs once
            self._check_native_inputs(input_ids, positions)
        if (
            self.decode_step is not None
            and metadata.num_prefills == 0
            and 0 < num_tokens <= self.native_decode_max_batch
            and logit_rows.shape[0] == num_tokens  # every row samples, in order
        ):
            self.decode_step.bind_caches(kv_caches)
            logits, self.argmax_logprobs = self.decode_step.run(
                input_ids,
                positions,
                metadata.slot_mapping,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
            )
            return logits
        rotate = self._native_rotary if self.fused_ops else self._torch_rotary(positions)
        backend.begin_step(metadata)
        residual = None
        x = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        for weights, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = self._add_norm(x, residual, weights.input_norm)
            qkv = linear(x, weights.qkv, weights.qkv_bias)
            q, k, v = rotate(qkv, positions)
            attn = backend.forward(q, k, v, key_cache, value_cache, metadata)
            o = linear(attn.reshape(num_tokens, self.q_size), weights.o)
            x, residual = self._add_norm(o, residual, weights.post_norm)
            x = linear(self._silu_mul(linear(x, weights.gate_up)), weights.down)
        assert residual is not None
        selected, _ = self._add_norm(x[logit_rows], residual[logit_rows], self.final_norm)
        return linear(selected, self.lm_head)

    # The decoder's elementwise steps, fused in C++ when `fused_ops` (CPU), else plain torch
    # in the reference's order (same rounding; fused sums may differ in the last bit).

    def _check_native_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Once per forward, what the unchecked native calls rely on: the rotary tables cover
        every position, and activations are contiguous CPU tensors of a supported dtype (they
        are: the model makes them, from its own weights)."""
        if positions.dtype != torch.int64 or positions.shape != input_ids.shape:
            raise ValueError(f"positions: expected [{input_ids.shape[0]}] int64")
        if not positions.is_contiguous():
            raise ValueError("positions: must be contiguous")
        cpu_ops.check_positions(positions, self.cos.shape[0])

    def _add_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        weight: torch.Tensor,  # [hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normalized residual + x, and residual + x
        eps = self.arch.rms_norm_eps
        if residual is None:
            normed = (
                cpu_ops.rms_norm(x, weight, eps, check=False)
                if self.fused_ops
                else rms_norm(x, weight, eps)
            )
            return normed, x
        if self.fused_ops:
            # residual += x in place
            return cpu_ops.rms_norm(x, weight, eps, residual=residual, check=False), residual
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def _split_heads(
        self, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v as [tokens, heads, dim]
        arch = self.arch
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = qkv.shape[0]
        return (
            q.view(n, arch.num_heads, arch.head_dim),
            k.view(n, arch.num_kv_heads, arch.head_dim),
            v.view(n, arch.num_kv_heads, arch.head_dim),
        )

    def _native_rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = self.arch.num_heads + self.arch.num_kv_heads  # q and k lead each row
        cpu_ops.rotary_(qkv, positions, self.cos, self.sin, heads, check=False)
        return self._split_heads(qkv)

    def _torch_rotary(self, positions: torch.Tensor) -> Callable[..., Any]:
        cos = self.cos[positions][:, None, :]  # [num_tokens, 1, head_dim]
        sin = self.sin[positions][:, None, :]

        def rotate(
            qkv: torch.Tensor, _: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = self._split_heads(qkv)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

        return rotate

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_ops:
            return cpu_ops.silu_mul(gate_up, check=False)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear_layers_only(self, num_tokens: int) -> None:
        """Run just the matmuls of one forward over `num_tokens` tokens (bench reference),
        with the model's own matmul implementation."""
        arch, linear = self.arch, self.linear

        def zeros(width: int) -> torch.Tensor:  # [num_tokens, width]
            return torch.zeros(num_tokens, width, dtype=self.dtype, device=self.device)

        x, attn, act = zeros(arch.hidden_size), zeros(self.q_size), zeros(arch.intermediate_size)
        for weights in self.layers:
            linear(x, weights.qkv, weights.qkv_bias)
            linear(attn, weights.o)
            linear(x, weights.gate_up)
            linear(act, weights.down)
        linear(x, self.lm_head)


def _native_decode_step(
    arch: ModelArchConfig,
    embed: torch.Tensor,  # [vocab, hidden]
    layers: list[LayerWeights],  # plain [out, in] weights, before any packing
    final_norm: torch.Tensor,  # [hidden]
    lm_head: torch.Tensor,  # [vocab, hidden]
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,  # [max_positions, head_dim]
) -> DecodeStep:
    shape = DecodeShape(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        rms_norm_eps=arch.rms_norm_eps,
    )
    plain = [
        DecodeLayer(w.input_norm, w.qkv, w.qkv_bias, w.o, w.post_norm, w.gate_up, w.down)
        for w in layers
    ]
    contiguous = [t.contiguous() for t in (embed, final_norm, lm_head, cos, sin)]
    return DecodeStep(shape, plain, *contiguous)


def native_decode_unsupported_reason(arch: ModelArchConfig, dtype: torch.dtype) -> str | None:
    """Why the native decode step cannot run this model, or None."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    return DecodeShape(
        arch.num_layers,
        arch.hidden_size,
        arch.intermediate_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.vocab_size,
        arch.rms_norm_eps,
    ).unsupported_reason()
