"""Sparse MLP: a router picks the top-k experts of each token (`MoeSpec.routing`); the experts
(with biases and gpt-oss's clamped SwiGLU where the family has them) run
grouped (the step's (token, expert) pairs sorted by expert, one matmul pair per active
expert), so the Python loop is over the few experts in use, never over tokens. A shared
expert (`MoeSpec.shared_expert_size`), gated per token, is added to the routed experts' sum.

Grouping needs each expert's token count on the host, which a CUDA graph cannot capture
(worker_service/cuda_graphs.py). While a stream is capturing, every expert runs over every
token instead and each output is weighted by the token's routing weight, zero for the experts
it did not pick: the same sums (adding a zero changes nothing), at the cost of reading every
expert's weights each decode step, which a decode batch of a few dozen tokens does anyway."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.models.arch import Activation, ModelArchConfig, MoeSpec
from worker_service.models.blocks import clamped_swiglu, gated_activation, rms_norm
from worker_service.models.weights import MoeWeights


def route(
    x: torch.Tensor,  # [num_tokens, hidden]
    router: torch.Tensor,  # [num_experts, hidden]
    spec: MoeSpec,
    router_bias: torch.Tensor | None = None,  # [num_experts]
    expert_scale: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] weights, expert ids
    """ "softmax_topk": softmax over all experts in float32, top-k, renormalised when
    `norm_topk_prob`; "topk_softmax": top-k logits, softmaxed in the model dtype;
    "scaled_softmax_topk": "softmax_topk" (x already scaled, see `parallel_moe_mlp`), each
    weight then times its expert's `expert_scale`."""
    logits = F.linear(x, router, router_bias)  # [num_tokens, num_experts]
    if spec.routing == "topk_softmax":
        top, experts = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.routing == "scaled_softmax_topk":
        assert expert_scale is not None
        weights = weights * expert_scale[experts]
    return weights, experts


def _routed(
    x: torch.Tensor, w: MoeWeights, spec: MoeSpec
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] weights, expert ids
    weights, experts = route(x, w.router, spec, w.router_bias, w.expert_scale)
    if spec.round_weights:  # Qwen3-MoE casts the routing weights to the model dtype first
        weights = weights.to(x.dtype)
    return weights, experts


def moe_mlp(
    x: torch.Tensor,  # [num_tokens, hidden]
    w: MoeWeights,
    spec: MoeSpec,
    activation: Activation,
    router_input: torch.Tensor | None = None,  # [num_tokens, hidden]; None: x
) -> torch.Tensor:  # [num_tokens, hidden]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        routed = every_expert_mlp(x, w, spec, activation, router_input)
    else:
        routed = _grouped_experts(x, w, spec, activation, router_input)
    if spec.shared_expert_size is None:
        return routed
    return routed + shared_expert_mlp(x, w, activation)


def shared_expert_mlp(
    x: torch.Tensor,  # [num_tokens, hidden]
    w: MoeWeights,
    activation: Activation,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The shared expert's MLP times sigmoid of its gate's logit for each token."""
    assert w.shared_gate_up is not None and w.shared_down is not None
    assert w.shared_gate is not None
    out = F.linear(gated_activation(F.linear(x, w.shared_gate_up), activation), w.shared_down)
    return torch.sigmoid(F.linear(x, w.shared_gate)) * out


def _grouped_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w: MoeWeights,
    spec: MoeSpec,
    activation: Activation,
    router_input: torch.Tensor | None,  # [num_tokens, hidden]; None: x
) -> torch.Tensor:  # [num_tokens, hidden]
    weights, experts = _routed(x if router_input is None else router_input, w, spec)
    flat = experts.reshape(-1)  # [num_tokens * top_k], token t's picks at t * top_k ...
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending
    token_of = order // spec.top_k  # [num_pairs]
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    rows = x[token_of]  # [num_pairs, hidden]
    out = torch.empty(  # [num_pairs, hidden], float32 when the weights are (Mixtral)
        rows.shape[0],
        x.shape[1],
        dtype=torch.promote_types(x.dtype, weights.dtype),
        device=x.device,
    )
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = _expert(rows[start:end], w, expert, spec, activation)
        out[start:end] = h * weights.reshape(-1)[order[start:end], None]
        start = end
    final = torch.zeros_like(x)
    # Each token's rows arrive in ascending expert order, as in the reference's loop.
    final.index_add_(0, token_of, out.to(x.dtype))
    return final


def every_expert_mlp(
    x: torch.Tensor,  # [num_tokens, hidden]
    w: MoeWeights,
    spec: MoeSpec,
    activation: Activation,
    router_input: torch.Tensor | None = None,  # [num_tokens, hidden]; None: x
) -> torch.Tensor:  # [num_tokens, hidden]
    """`moe_mlp` without a host sync (see the module docstring): every expert over every token,
    weighted by a [num_tokens, num_experts] gate that holds each token's routing weights at its
    picks and zeros elsewhere; outputs are added in ascending expert order, like the grouped
    path's."""
    weights, experts = _routed(x if router_input is None else router_input, w, spec)
    gates = torch.zeros(x.shape[0], spec.num_experts, dtype=weights.dtype, device=x.device)
    gates.scatter_(1, experts, weights)
    final = torch.zeros_like(x)
    for expert in range(spec.num_experts):
        final += (_expert(x, w, expert, spec, activation) * gates[:, expert, None]).to(x.dtype)
    return final


def _expert(
    x: torch.Tensor,  # [rows, hidden]
    w: MoeWeights,
    expert: int,
    spec: MoeSpec,
    activation: Activation,
) -> torch.Tensor:  # [rows, hidden], before the routing weight
    """One expert's MLP; biases are added after each matmul, as the references do."""
    gate_up = F.linear(x, w.gate_up[expert])
    if w.gate_up_bias is not None:
        gate_up = gate_up + w.gate_up_bias[expert]
    if spec.swiglu_limit is not None:
        h = clamped_swiglu(gate_up, spec.swiglu_alpha, spec.swiglu_limit)
    else:
        h = gated_activation(gate_up, activation)
    out = F.linear(h, w.down[expert])
    if w.down_bias is not None:
        out = out + w.down_bias[expert]
    return out


def parallel_moe_mlp(
    dense_out: torch.Tensor,  # [num_tokens, hidden], the dense MLP's output
    x: torch.Tensor,  # [num_tokens, hidden], the block's input (before the pre-MLP norm)
    w: MoeWeights,
    arch: ModelArchConfig,
) -> torch.Tensor:  # [num_tokens, hidden], before the layer's post-MLP norm
    """Gemma 4's experts beside the dense MLP (see the module docstring)."""
    assert arch.moe is not None and w.router_scale is not None
    eps, norm = arch.rms_norm_eps, arch.norm
    router_input = rms_norm(x, None, eps) * w.router_scale * arch.hidden_size**-0.5
    experts = moe_mlp(
        rms_norm(x, w.input_norm, eps, norm), w, arch.moe, arch.activation, router_input
    )
    return rms_norm(dense_out, w.dense_out_norm, eps, norm) + rms_norm(
        experts, w.out_norm, eps, norm
    )
