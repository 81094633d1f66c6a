"""The Gated DeltaNet mixer of Qwen3.5 and Qwen3-Next's linear-attention layers, over a step's
tokens and the layer's state pools (`worker_service.linear_state`).

One matmul projects the normalized input into the convolution's channels (q, k and v), the
output gate z and the per-head inputs b and a of the delta rule's step and decay. q, k and v
run through a short causal convolution (`llmserve_kernels.causal_conv1d`), then SiLU, then the gated
delta rule (`llmserve_kernels.gated_delta_rule`, q and k L2-normalised inside); each value head's
output is RMS-normalized, times its weight, times SiLU(z), and projected back to the hidden
size. The arithmetic and its rounding points follow transformers' `Qwen3_5GatedDeltaNet`:
the convolution's output and the step beta are rounded to the model dtype, as there (which
keeps bfloat16 outputs as close to transformers' as the attention families' are).

The step's prefill sequences (several tokens each, first in the step) run through the packed
kernels, which carry each sequence's state across its chunks; the decode rows (one token per
sequence, last) through the decode kernels, which update every sequence's state at once
instead of looping over sequences. `StateOps` names both sets: the torch references, or the
C++ kernels of `llmserve_kernels.cpu` (the `cpu` backend). A one-token sequence with no state yet
(`has_initial_state` False) has its slot zeroed first: the decode kernels always read it.
Sequences verifying drafts have several decode rows: they run in waves (`DraftRows`), one row
of each sequence at a time, keeping the states a rejected draft goes back to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve_kernels import causal_conv1d as conv_ops
from llmserve_kernels import gated_delta_rule as delta_ops
from llmserve_kernels.cpu import linear_attention as cpu_ops
from worker_service.linear_state import DraftRows, StateMetadata
from worker_service.models.arch import LinearAttentionSpec
from worker_service.models.blocks import rms_norm


@dataclass(slots=True)
class DeltaNetWeights:
    """One linear-attention layer's weights (`LinearAttentionSpec` names the widths)."""

    # [conv_dim + value_width + 2 * num_v_heads, hidden]: q, k, v rows (the convolution's
    # channels, heads in order), then z, b and a rows
    in_proj: torch.Tensor
    # [conv_dim, conv_kernel]: the transposed view of a [conv_kernel, conv_dim] tensor, which
    # the native decode kernel reads as it is
    conv: torch.Tensor
    a_log: torch.Tensor  # [num_v_heads]
    dt_bias: torch.Tensor  # [num_v_heads]
    norm: torch.Tensor  # [v_dim], the gated norm's weight (applied as is, not 1 + w)
    out_proj: torch.Tensor  # [hidden, value_width]
    conv_bias: torch.Tensor | None = None  # [conv_dim]

    def tensors(self) -> list[torch.Tensor]:
        held = [self.in_proj, self.conv, self.a_log, self.dt_bias, self.norm, self.out_proj]
        return held + ([] if self.conv_bias is None else [self.conv_bias])


@dataclass(frozen=True, slots=True)
class StateOps:
    """The kernels a layer's states run on: the packed kernels for the prefill sequences, the
    one-token-per-sequence kernels for the decode rows."""

    conv: Callable[..., torch.Tensor]  # as `causal_conv1d.causal_conv1d`
    delta_prefill: Callable[..., torch.Tensor]  # as `gated_delta_rule.gated_delta_rule_chunked`
    conv_update: Callable[..., torch.Tensor]  # as `causal_conv1d.causal_conv1d_update`
    delta_decode: Callable[..., torch.Tensor]  # as `gated_delta_rule.gated_delta_rule_decode`


TORCH_STATE_OPS = StateOps(
    conv_ops.causal_conv1d,
    delta_ops.gated_delta_rule_chunked,
    conv_ops.causal_conv1d_update,
    delta_ops.gated_delta_rule_decode,
)
NATIVE_STATE_OPS = StateOps(
    cpu_ops.causal_conv1d,
    cpu_ops.gated_delta_rule_prefill,
    cpu_ops.causal_conv1d_update,
    cpu_ops.gated_delta_rule_decode,
)


@dataclass(slots=True)
class StateStep:
    """A step's `StateMetadata` split into its prefill and decode parts, once per step for
    every linear-attention layer."""

    num_prefill_tokens: int
    prefill_starts: torch.Tensor  # [num_prefills + 1] int32
    prefill_slots: torch.Tensor  # [num_prefills] int32
    prefill_initial: torch.Tensor  # [num_prefills] bool
    decode_slots: torch.Tensor  # [num_decodes] int32
    fresh_decode_slots: torch.Tensor  # [num_fresh] int64: decode rows' slots without a state
    draft_rows: DraftRows | None  # the decode rows in waves, when some sequences have drafts

    @classmethod
    def split(cls, metadata: StateMetadata, num_tokens: int) -> StateStep:
        """The parts of a step of `num_tokens` tokens: prefill tokens first, then one token
        per decode row."""
        p = metadata.num_prefills
        decode_slots = metadata.state_slots[p:]
        fresh = decode_slots[~metadata.has_initial_state[p:]].long()
        return cls(
            num_prefill_tokens=num_tokens - metadata.num_decodes,
            prefill_starts=metadata.query_start_loc[: p + 1],
            prefill_slots=metadata.state_slots[:p],
            prefill_initial=metadata.has_initial_state[:p],
            decode_slots=decode_slots,
            fresh_decode_slots=fresh,
            draft_rows=metadata.draft_rows,
        )


def gated_delta_net(
    h: torch.Tensor,  # [num_tokens, hidden], the normalized layer input
    w: DeltaNetWeights,
    spec: LinearAttentionSpec,
    conv_state: torch.Tensor,  # [num_slots, conv_kernel - 1, conv_dim], updated in place
    recurrent_state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated in place
    step: StateStep,
    eps: float,
    linear: Callable[..., torch.Tensor],
    ops: StateOps = TORCH_STATE_OPS,
    layer: int = 0,  # the layer's index, for the states kept between draft rows
) -> torch.Tensor:  # [num_tokens, hidden]
    """The mixer over a step's tokens; each sequence's slot then holds its state after its
    last token. `linear` is the model's matmul (`DecoderModel.linear`)."""
    n, p = h.shape[0], step.num_prefill_tokens
    projected = linear(h, w.in_proj)  # [num_tokens, in_proj rows]
    mixed, z, b, a = projected.split(
        [spec.conv_dim, spec.value_width, spec.num_v_heads, spec.num_v_heads], dim=-1
    )
    g, beta = delta_ops.gated_delta_gates(a, b, w.a_log, w.dt_bias)  # [num_tokens, v_heads]
    core = h.new_empty(n, spec.num_v_heads, spec.v_dim)
    if p > 0:
        convolved = ops.conv(
            mixed[:p],
            conv_state,
            w.conv,
            w.conv_bias,
            step.prefill_starts,
            step.prefill_slots,
            step.prefill_initial,
            activation=None,
        )
        q, k, v = _heads(F.silu(convolved), spec)
        core[:p] = ops.delta_prefill(
            q,
            k,
            v,
            g[:p],
            beta[:p],
            recurrent_state,
            step.prefill_starts,
            step.prefill_slots,
            step.prefill_initial,
        )
    if p < n:
        if step.fresh_decode_slots.numel():
            conv_state[step.fresh_decode_slots] = 0
            recurrent_state[step.fresh_decode_slots] = 0
        rows = step.draft_rows
        # Per wave: its token rows, and the same rows among the decode rows.
        waves: list[tuple[slice | torch.Tensor, slice | torch.Tensor]] = (
            [(slice(p, n), slice(None))] if rows is None else [(p + i, i) for i in rows.waves]
        )
        for wave, (at, among) in enumerate(waves):
            slots = step.decode_slots[among]
            convolved = ops.conv_update(
                mixed[at].contiguous(), conv_state, w.conv, w.conv_bias, slots, None
            )
            q, k, v = _heads(F.silu(convolved), spec)
            core[at] = ops.delta_decode(q, k, v, g[at], beta[at], recurrent_state, slots)
            if rows is not None:
                rows.keep(layer, wave, conv_state, recurrent_state)
    gated = _gated_norm(core, z.reshape(n, spec.num_v_heads, spec.v_dim), w.norm, eps)
    return linear(gated.reshape(n, spec.value_width), w.out_proj)


def _heads(
    convolved: torch.Tensor,  # [num_tokens, conv_dim]
    spec: LinearAttentionSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k [tokens, k_heads, k_dim]; v
    n = convolved.shape[0]
    q, k, v = convolved.split([spec.key_width, spec.key_width, spec.value_width], dim=-1)
    return (
        q.view(n, spec.num_k_heads, spec.k_dim),
        k.view(n, spec.num_k_heads, spec.k_dim),
        v.view(n, spec.num_v_heads, spec.v_dim),
    )


def _gated_norm(
    core: torch.Tensor,  # [num_tokens, num_v_heads, v_dim], the delta rule's output
    z: torch.Tensor,  # [num_tokens, num_v_heads, v_dim], the output gate
    weight: torch.Tensor,  # [v_dim]
    eps: float,
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_dim]
    """RMS-normalize each head's output (weight times the normalized value cast back, as
    Llama's norm), times SiLU(z) in float32, cast back."""
    return (rms_norm(core, weight, eps, "rms") * F.silu(z.float())).to(core.dtype)
