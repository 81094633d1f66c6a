"""Per-layer weight containers and the readers that take them from transformers modules.

Families map their modules onto these fields (see `registry.Family`); shared readers cover
the common module names (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj, fused
qkv_proj/gate_up_proj, experts stored as fused 3-D tensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker_service.models.delta_net import DeltaNetWeights


@dataclass(slots=True)
class MoeWeights:
    router: torch.Tensor  # [num_experts, hidden]
    gate_up: torch.Tensor  # [num_experts, 2 * moe_intermediate, hidden]: gate rows, up rows
    down: torch.Tensor  # [num_experts, hidden, moe_intermediate]
    # Biases where the family's router or experts have them (gpt-oss).
    router_bias: torch.Tensor | None = None  # [num_experts]
    gate_up_bias: torch.Tensor | None = None  # [num_experts, 2 * moe_intermediate]
    down_bias: torch.Tensor | None = None  # [num_experts, hidden]
    # Gemma 4's router scales its normalized input by `router_scale` and each pick by its
    # expert's `expert_scale`; its experts, beside the dense MLP, have their own norms: on
    # the block's input (`input_norm`), on their sum (`out_norm`) and on the dense MLP's
    # output (`dense_out_norm`) before the two are added.
    router_scale: torch.Tensor | None = None  # [hidden]
    expert_scale: torch.Tensor | None = None  # [num_experts]
    input_norm: torch.Tensor | None = None  # [hidden]
    out_norm: torch.Tensor | None = None  # [hidden]
    dense_out_norm: torch.Tensor | None = None  # [hidden]
    # The shared expert (`MoeSpec.shared_expert_size` S wide) and its gate.
    shared_gate_up: torch.Tensor | None = None  # [2 * S, hidden]: gate rows, up rows
    shared_down: torch.Tensor | None = None  # [hidden, S]
    shared_gate: torch.Tensor | None = None  # [1, hidden]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, biases and scales included."""
        held = [self.router, self.gate_up, self.down]
        extra = (
            self.router_bias,
            self.gate_up_bias,
            self.down_bias,
            self.router_scale,
            self.expert_scale,
            self.input_norm,
            self.out_norm,
            self.dense_out_norm,
            self.shared_gate_up,
            self.shared_down,
            self.shared_gate,
        )
        return held + [t for t in extra if t is not None]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. Norm names say where a norm sits: `input_norm` before attention,
    `attn_out_norm` on the attention output, `post_norm` before the MLP (Llama's
    post_attention_layernorm), `mlp_out_norm` on the MLP output. A linear-attention layer
    (`LayerKind.linear`) has `delta_net` in place of qkv and o."""

    input_norm: torch.Tensor | None  # [hidden]
    # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]: q, k, v rows, then num_heads *
    # head_dim gate rows with `arch.attention_output_gate`; None in a linear-attention layer
    qkv: torch.Tensor | None
    qkv_bias: torch.Tensor | None  # [qkv rows]
    o: torch.Tensor | None  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor | None  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in an MoE layer
    down: torch.Tensor | None  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 * intermediate]
    down_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim] per head, or [num_heads * head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim] per head, or [num_kv_heads * head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    moe: MoeWeights | None = None
    sinks: torch.Tensor | None = None  # [num_heads], attention sink logits (gpt-oss)
    # Gemma 4's per-layer input branch (`arch.per_layer_input_size` P wide) and scalar.
    per_layer_gate: torch.Tensor | None = None  # [P, hidden]
    per_layer_proj: torch.Tensor | None = None  # [hidden, P]
    per_layer_norm: torch.Tensor | None = None  # [hidden]
    layer_scalar: torch.Tensor | None = None  # [1]
    delta_net: DeltaNetWeights | None = None  # a linear-attention layer's mixer


def _w(module: Any) -> torch.Tensor:
    return module.weight.detach()


def _b(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach()


def _cat_bias(*modules: Any) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in modules]
    if all(b is None for b in biases):
        return None
    filled = [
        b if b is not None else torch.zeros_like(m.weight[:, 0])
        for b, m in zip(biases, modules, strict=True)
    ]
    return torch.cat(filled).detach()


def norm_weight(module: Any | None) -> torch.Tensor | None:
    return None if module is None else module.weight.detach()


def read_attention(
    attn: Any, kv_shared: bool = False, output_gate: bool = False
) -> dict[str, Any]:  # LayerWeights fields
    """q/k/v fused into one projection (or taken fused: Phi-3's qkv_proj), o, and q/k norms.
    A layer without `v_proj` (Gemma 4's attention_k_eq_v) uses its keys' projection for the
    values too: its rows come twice. `kv_shared`: the layer reads another layer's K/V, and
    its "qkv" is the query projection alone. `output_gate`: `q_proj` holds each head's query
    rows then its gate rows (Qwen3.5, Qwen3-Next); the gate rows move after v's."""
    if hasattr(attn, "qkv_proj"):
        qkv, qkv_bias = _w(attn.qkv_proj), _b(attn.qkv_proj)
    elif output_gate:
        qkv, qkv_bias = _gated_qkv(attn)
    elif kv_shared:
        qkv, qkv_bias = _w(attn.q_proj), _b(attn.q_proj)
    else:
        v_proj = attn.k_proj if getattr(attn, "v_proj", None) is None else attn.v_proj
        qkv = torch.cat([_w(attn.q_proj), _w(attn.k_proj), _w(v_proj)])
        qkv_bias = _cat_bias(attn.q_proj, attn.k_proj, v_proj)
    return dict(
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=_w(attn.o_proj),
        o_bias=_b(attn.o_proj),
        q_norm=norm_weight(getattr(attn, "q_norm", None)),
        k_norm=None if kv_shared else norm_weight(getattr(attn, "k_norm", None)),
        sinks=_sinks(attn),
    )


def _gated_qkv(attn: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k and v rows, then the gate rows, of a gated attention's projections."""

    def reorder(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads = q.view(-1, 2, attn.head_dim, *q.shape[1:])  # [num_heads, query/gate, ...]
        return torch.cat([heads[:, 0].flatten(0, 1), k, v, heads[:, 1].flatten(0, 1)])

    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = reorder(*(_w(m) for m in projections))
    biases = [_b(m) for m in projections]
    if all(b is None for b in biases):
        return weight, None
    filled = [
        b if b is not None else torch.zeros_like(m.weight[:, 0])
        for b, m in zip(biases, projections, strict=True)
    ]
    return weight, reorder(*filled)


def _sinks(attn: Any) -> torch.Tensor | None:
    sinks = getattr(attn, "sinks", None)
    return None if sinks is None else sinks.detach()


def read_dense_mlp(mlp: Any) -> dict[str, torch.Tensor | None]:
    """gate and up fused into one projection (or taken fused: Phi-3's gate_up_proj)."""
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp.gate_up_proj, "weight"):
        gate_up, gate_up_bias = _w(mlp.gate_up_proj), _b(mlp.gate_up_proj)
    else:
        gate_up = torch.cat([_w(mlp.gate_proj), _w(mlp.up_proj)])
        gate_up_bias = _cat_bias(mlp.gate_proj, mlp.up_proj)
    return dict(
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=_w(mlp.down_proj),
        down_bias=_b(mlp.down_proj),
    )


def read_moe(block: Any, router: Any, gate_up_interleaved: bool = False) -> MoeWeights:
    """Experts stored as transformers 5 stores them: `gate_up_proj` [experts, 2 * inter,
    hidden] and `down_proj` [experts, hidden, inter] parameters of one module (or their
    transposes, `is_transposed`), with `*_bias` parameters where the family has them.
    `gate_up_interleaved`: gate and up alternate along the 2 * inter outputs (gpt-oss), and
    are taken apart here into the gate-then-up order the MLP expects."""
    experts = block.experts
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(
            f"experts: expected fused 3-D gate_up_proj/down_proj, got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate_up_bias = _param(experts, "gate_up_proj_bias")
    if gate_up_interleaved:
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        if gate_up_bias is not None:
            gate_up_bias = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
    return MoeWeights(
        router=router.weight.detach(),
        gate_up=gate_up.contiguous(),
        down=down.contiguous(),
        router_bias=_b(router),
        gate_up_bias=gate_up_bias,
        down_bias=_param(experts, "down_proj_bias"),
    )


def _param(module: Any, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return None if value is None else value.detach()


def read_layer(
    layer: Any,
    *,
    input_norm: str | None = "input_layernorm",
    attn_out_norm: str | None = None,
    post_norm: str | None = "post_attention_layernorm",
    mlp_out_norm: str | None = None,
    moe: MoeWeights | None = None,
    dense_beside_moe: bool = False,
    kv_shared: bool = False,
    output_gate: bool = False,
    delta_net: DeltaNetWeights | None = None,
) -> LayerWeights:
    """A layer whose norms have these module names (None: the layer has no such norm).
    `dense_beside_moe`: the layer keeps its dense MLP next to `moe` (Gemma 4); `kv_shared`
    and `output_gate`: see `read_attention`; `delta_net`: a linear-attention layer's mixer,
    read by its family, in place of attention."""

    def norm(name: str | None) -> torch.Tensor | None:
        return None if name is None else _w(getattr(layer, name))

    mlp = {} if moe is not None and not dense_beside_moe else read_dense_mlp(layer.mlp)
    if delta_net is None:
        attention = read_attention(layer.self_attn, kv_shared, output_gate)
    else:
        attention = dict(qkv=None, qkv_bias=None, o=None)
    return LayerWeights(
        input_norm=norm(input_norm),
        post_norm=norm(post_norm),
        attn_out_norm=norm(attn_out_norm),
        mlp_out_norm=norm(mlp_out_norm),
        gate_up=mlp.get("gate_up"),
        down=mlp.get("down"),
        gate_up_bias=mlp.get("gate_up_bias"),
        down_bias=mlp.get("down_bias"),
        moe=moe,
        delta_net=delta_net,
        **attention,
    )


_PROJECTIONS = ("qkv", "o", "gate_up", "down", "per_layer_gate", "per_layer_proj")


def convert_projections(
    layers: list[LayerWeights], convert: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Each layer's projections (and a linear-attention layer's in/out projections) replaced
    by `convert` of them, in place (prepacking, making contiguous)."""
    for w in layers:
        for name in _PROJECTIONS:
            tensor = getattr(w, name)
            if tensor is not None:
                setattr(w, name, convert(tensor))
        if w.delta_net is not None:
            w.delta_net.in_proj = convert(w.delta_net.in_proj)
            w.delta_net.out_proj = convert(w.delta_net.out_proj)
