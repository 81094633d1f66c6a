"""One decoder for every family, over a flat batch of tokens and the paged KV cache.

Every linear layer runs once per step over all tokens of all sequences (`[num_tokens, ...]`),
q/k/v and gate/up are fused into one matmul each, and attention goes through an
`AttentionBackend` that reads and writes the paged KV cache. A layer is: (input norm) ->
attention (q/k norms, rotary unless NoPE, the layer's sliding window) -> (output norm) ->
residual add -> (pre-MLP norm) -> dense or sparse MLP (or both, Gemma 4) -> (output norm) ->
residual add -> (a per-layer input branch, `per_layer_inputs`) -> (times a layer scalar); what
each family has of these is declared in its `ModelArchConfig` (see `registry`). A layer that
reads another layer's K/V (`LayerKind.kv_source`) projects queries only and attends over its
source's keys and values, this step's included, without writing the cache. A linear-attention
layer (`LayerKind.linear`, Qwen3.5 and Qwen3-Next) runs the Gated DeltaNet mixer
(`delta_net`) over its state pools in place of attention; with `attention_output_gate` the
attention output is gated (times the sigmoid of the gate rows of the q/k/v projection)
before the output projection.

CPU fast paths: with `fused_ops` the residual add + norm (each family's kind), the blocks' output
norms, the q/k norms, rotary and SiLU- or GELU-and-multiply are single C++ calls from
`llmserve_kernels.cpu` (`elementwise`; for models without the features those kernels lack,
`arch.fused_blockers`: KV-shared layers, per-layer attention shapes; such models take the plain
torch elementwise path), and the linear-attention layers' decode rows run on the C++ state kernels
(`llmserve_kernels.cpu.linear_attention`); with `packed_linear` every matmul runs through oneDNN on
weights prepacked at load; with `native_linear` through
`llmserve_kernels.cpu.linear_rows.linear_rows`; and pure decode steps of up to
`native_decode_max_batch` tokens run as one native call (`native.NativeDecode`) for every dense
family; it refuses the others (`arch.native_blockers`: experts, attention sinks, linear-attention
layers...) by feature name and they decode on the per-layer path.
The elementwise arithmetic follows each reference's order, so float32 greedy output matches
transformers token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmserve_kernels.cpu.decode import ArgmaxLogprobs, DecodeStep
from llmserve_kernels.cpu.pool import set_num_threads
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.linear_state import StateMetadata
from worker_service.models.arch import ModelArchConfig
from worker_service.models.blocks import embedding_multiplier, rms_norm, softcap
from worker_service.models.delta_net import (
    NATIVE_STATE_OPS,
    TORCH_STATE_OPS,
    StateStep,
    gated_delta_net,
)
from worker_service.models.elementwise import TorchElementwise, elementwise_ops
from worker_service.models.linear import (
    native_matmul,
    pack_weight,
    packed_linear_available,
    packed_matmul,
)
from worker_service.models.moe import moe_mlp, parallel_moe_mlp
from worker_service.models.native import (
    NativeDecode,
    default_native_max_batch,
    native_decode_unsupported_reason,
)
from worker_service.models.per_layer_inputs import (
    PerLayerInputWeights,
    per_layer_branch,
    per_layer_inputs,
)
from worker_service.models.rope import cos_sin_for
from worker_service.models.weights import LayerWeights, convert_projections


class DecoderModel:
    """Forward pass of a decoder-only causal LM over the paged cache. Not an nn.Module: plain
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
        native_decode_max_batch: int | None = 0,
        per_layer_input_weights: PerLayerInputWeights | None = None,
    ) -> None:
        if (per_layer_input_weights is None) != (arch.per_layer_input_size is None):
            raise ValueError("per-layer input weights are given exactly when the arch has them")
        self.arch = arch
        self.packed_linear = packed_linear
        self.linear: Callable[..., torch.Tensor] = F.linear
        # The embedding lookup: (input_ids, self.embed) -> [num_tokens, hidden].
        self.embedding: Callable[..., torch.Tensor] = F.embedding
        # One cos/sin table per distinct rotary spec; layers index them (`LayerKind.rope`).
        self.rope_tables = [
            cos_sin_for(spec, max_positions, embed.dtype, embed.device) for spec in arch.ropes
        ]
        # CPU only: the norms, rotary and the gated activation in C++ (`fused_blockers`).
        self.elementwise = elementwise_ops(arch, self.rope_tables, fused_ops)
        self.fused_ops = self.elementwise.fused
        # The kernels linear-attention layers' states run on: C++ where the native CPU ops
        # were asked for (whether or not the model's elementwise ops can take them).
        self.state_ops = NATIVE_STATE_OPS if fused_ops else TORCH_STATE_OPS
        self.native_decode: NativeDecode | None = None
        # Why decode steps run per layer although the native step was asked for, or None.
        self.native_decode_refused: str | None = None
        # Each row's argmax and its logprob when the last forward ran the native decode step
        # (which finds them while the logits are in cache), else None.
        self.argmax_logprobs: ArgmaxLogprobs | None = None
        if native_decode_max_batch is None:
            native_decode_max_batch = default_native_max_batch(arch)
        if fused_ops or native_decode_max_batch > 0 or native_linear:
            set_num_threads(torch.get_num_threads())  # the C++ kernels' own threads (pool.h)
        if native_decode_max_batch > 0:
            if not fused_ops:
                raise ValueError("the native decode step needs the native CPU ops (fused_ops)")
            # A model it cannot run decodes on the per-layer path (native.py).
            self.native_decode_refused = native_decode_unsupported_reason(arch, embed.dtype)
            if self.native_decode_refused is None:
                self.native_decode = NativeDecode(
                    arch,
                    embed,
                    layers,
                    final_norm,
                    lm_head,
                    self.rope_tables,
                    native_decode_max_batch,
                )
        if packed_linear:
            if not packed_linear_available(embed.device, embed.dtype):
                raise ValueError(
                    f"packed linear layers need oneDNN on the CPU in float32 or bfloat16, "
                    f"not {embed.device} {embed.dtype}"
                )
            convert_projections(layers, pack_weight)
            if per_layer_input_weights is not None:
                per_layer_input_weights.projection = pack_weight(per_layer_input_weights.projection)
            lm_head = pack_weight(lm_head)  # a copy: the embedding (often the same tensor) stays
            self.linear = packed_matmul
        elif native_linear:
            convert_projections(layers, lambda t: t.contiguous())
            if per_layer_input_weights is not None:
                projection = per_layer_input_weights.projection.contiguous()
                per_layer_input_weights.projection = projection
            lm_head = lm_head.contiguous()
            self.linear = native_matmul
        # How the weights are held: their dtype, or what models/gguf_weights.py installed.
        self.weight_format = str(embed.dtype).removeprefix("torch.")
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        # The KV group of each layer (`llmserve.kv_layout`): which of a step's metadata and
        # backends it attends with. One group unless the worker lays the cache out in more.
        self.layer_groups: tuple[int, ...] = (0,) * arch.num_layers
        self.per_layer_input_weights = per_layer_input_weights
        # The layers whose K/V of a step a later layer reads (KV sharing).
        self._kv_sources = frozenset(arch.kv_sources.values())
        self._embed_scale = embedding_multiplier(
            arch.embed_scale, arch.round_embed_scale, self.dtype
        )

    @property
    def decode_step(self) -> DecodeStep | None:
        """The native decode step, when this model runs one."""
        return None if self.native_decode is None else self.native_decode.step

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        # Per layer: its K and V caches; a linear-attention layer's conv and recurrent state
        # pools (`linear_state`)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata | list[AttentionMetadata],  # one, or one per KV group
        backend: AttentionBackend | list[AttentionBackend],  # one, or one per KV group
        logit_rows: torch.Tensor,  # [num_logit_rows] int64, token rows that need logits
        state_metadata: StateMetadata | None = None,  # with linear-attention layers
    ) -> torch.Tensor:  # [num_logit_rows, vocab] in the model dtype (the sampler upcasts)
        self.argmax_logprobs = None
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions: expected [{input_ids.shape[0]}], like input_ids")
        # Before the native step too: it indexes the rotary tables unchecked, as the fused ops do.
        self.elementwise.begin_step(positions)
        metadatas = metadata if isinstance(metadata, list) else [metadata]
        backends = backend if isinstance(backend, list) else [backend]
        if self.native_decode is not None and self.native_decode.accepts(metadatas, logit_rows):
            logits, self.argmax_logprobs = self.native_decode.run(
                input_ids, positions, kv_caches, metadatas, self.layer_groups
            )
            return logits
        arch = self.arch
        for group_backend, group_metadata in zip(backends, metadatas, strict=True):
            group_backend.begin_step(group_metadata)
        layer_groups = self.layer_groups if len(metadatas) > 1 else (0,) * arch.num_layers
        states = self._state_step(state_metadata, input_ids.shape[0])
        x = self.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        if self._embed_scale is not None:
            x = x * self._embed_scale
        layer_inputs = None  # [num_tokens, num_layers, P]
        if self.per_layer_input_weights is not None:
            layer_inputs = per_layer_inputs(
                input_ids, x, self.per_layer_input_weights, arch, self.linear
            )
        # This step's K/V of the layers that later layers read (KV sharing).
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        delta: torch.Tensor | None = None  # the last block's output, not yet added to x
        for i, (weights, (key_cache, value_cache)) in enumerate(
            zip(self.layers, kv_caches, strict=True)
        ):
            kind = arch.layers[i]
            h, x = self.elementwise.add_norm(delta, x, weights.input_norm)
            if kind.linear:
                o = self._linear_attention(h, weights, key_cache, value_cache, states, i)
            else:
                gate = None  # [num_tokens, num_heads * head_dim]
                if kind.kv_source is None:
                    q, k, v, gate = self._qkv(h, weights, kind.rope, i)
                    if i in self._kv_sources:
                        step_kv[i] = (k, v)
                else:
                    q = self._q_only(h, weights, kind.rope, i)
                    k, v = step_kv[kind.kv_source]
                g = layer_groups[i]
                attn = backends[g].forward(
                    q,
                    k,
                    v,
                    key_cache,
                    value_cache,
                    metadatas[g],
                    sliding_window=kind.sliding_window,
                    sinks=weights.sinks,
                    write_kv=kind.kv_source is None,
                )
                o = self._attention_output(attn, gate, weights)
            delta = self._block_output(o, weights.attn_out_norm)
            h, x = self.elementwise.add_norm(delta, x, weights.post_norm)
            delta = self._block_output(self._mlp(h, x, weights), weights.mlp_out_norm)
            if layer_inputs is not None or weights.layer_scalar is not None:
                x, delta = self._layer_tail(x + delta, weights, layer_inputs, i), None
        selected, _ = self.elementwise.add_norm(
            None if delta is None else delta[logit_rows], x[logit_rows], self.final_norm
        )
        logits = self.linear(selected, self.lm_head)
        if arch.logits_divisor is not None:
            logits = logits / arch.logits_divisor
        if arch.final_softcap is not None:
            logits = softcap(logits, arch.final_softcap)
        return logits

    def _layer_tail(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream after the MLP
        weights: LayerWeights,
        layer_inputs: torch.Tensor | None,  # [num_tokens, num_layers, P]
        index: int,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Gemma 4's end of a layer: the per-layer input branch, then the layer scalar."""
        if layer_inputs is not None:
            x = x + per_layer_branch(x, layer_inputs[:, index], weights, self.arch, self.linear)
        if weights.layer_scalar is not None:
            x = x * weights.layer_scalar
        return x

    def _attention_output(
        self,
        attn: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        gate: torch.Tensor | None,  # [num_tokens, num_heads * head_dim]
        weights: LayerWeights,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The output projection of the attention, gated first where the arch gates it."""
        out = attn.reshape(attn.shape[0], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.linear(out, weights.o, weights.o_bias)

    def _state_step(
        self, state_metadata: StateMetadata | None, num_tokens: int
    ) -> StateStep | None:
        """The step's states split once for every linear-attention layer (None: the model
        has none)."""
        if not self.arch.linear_layers:
            return None
        if state_metadata is None:
            raise ValueError(
                f"{self.arch.architecture} has linear-attention layers: forward needs "
                f"state_metadata"
            )
        return StateStep.split(state_metadata, num_tokens)

    def _linear_attention(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        weights: LayerWeights,
        conv_state: torch.Tensor,  # [num_slots, conv_kernel - 1, conv_dim]
        recurrent_state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim] float32
        states: StateStep | None,
        layer: int,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        spec = self.arch.linear_attention
        assert spec is not None and states is not None and weights.delta_net is not None
        return gated_delta_net(
            h,
            weights.delta_net,
            spec,
            conv_state,
            recurrent_state,
            states,
            self.arch.rms_norm_eps,
            self.linear,
            self.state_ops,
            layer,
        )

    def _block_output(
        self, out: torch.Tensor, norm: torch.Tensor | None
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if norm is not None:
            out = self.elementwise.norm(out, norm)
        if self.arch.residual_scale is not None:
            out = out * self.arch.residual_scale
        return out

    def _qkv(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        weights: LayerWeights,
        rope: int | None,  # the layer's rotary table; None: NoPE
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v [num_tokens, heads, head_dim] each (the layer's head size), and the output
        gate [num_tokens, num_heads * head_dim] with `arch.attention_output_gate` (else
        None)."""
        arch = self.arch
        assert weights.qkv is not None
        num_kv_heads, head_dim = arch.kv_shape(layer)
        q_size, kv_size = arch.num_heads * head_dim, num_kv_heads * head_dim
        qkv = self.linear(h, weights.qkv, weights.qkv_bias)
        q, k = self.elementwise.queries_keys(qkv, weights, rope, num_kv_heads, head_dim)
        values = qkv[:, q_size + kv_size : q_size + 2 * kv_size]
        v = values.view(qkv.shape[0], num_kv_heads, head_dim)
        if arch.value_norm:
            v = rms_norm(v, None, arch.rms_norm_eps)
        gate = qkv[:, q_size + 2 * kv_size :] if arch.attention_output_gate else None
        return q, k, v, gate

    def _q_only(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        weights: LayerWeights,  # qkv: the query projection alone
        rope: int | None,
        layer: int,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """The queries of a layer that reads another layer's K/V (per-head q norm only:
        `fused_blockers` keeps the fused ops off for the families that share K/V)."""
        arch = self.arch
        assert isinstance(self.elementwise, TorchElementwise)
        assert arch.qk_norm != "full" and not arch.attention_output_gate
        assert weights.qkv is not None
        head_dim = arch.layer_head_dim(layer)
        q = self.linear(h, weights.qkv, weights.qkv_bias).view(-1, arch.num_heads, head_dim)
        return self.elementwise.queries(q, weights, rope)

    def _mlp(
        self,
        h: torch.Tensor,  # [num_tokens, hidden], the normalized block input
        x: torch.Tensor,  # [num_tokens, hidden], the block input (Gemma 4's experts read it)
        weights: LayerWeights,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        arch = self.arch
        if weights.moe is not None and weights.gate_up is None:
            assert arch.moe is not None
            return moe_mlp(h, weights.moe, arch.moe, arch.activation)
        gate_up = self.linear(h, weights.gate_up, weights.gate_up_bias)
        act = self.elementwise.gated_activation(gate_up)
        dense = self.linear(act, weights.down, weights.down_bias)
        if weights.moe is not None:  # experts beside the dense MLP
            return parallel_moe_mlp(dense, x, weights.moe, arch)
        return dense


# The name the worker used before the families came.
LlamaModel = DecoderModel
