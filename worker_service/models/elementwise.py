"""A decoder layer's elementwise steps: the residual add and norms, the q/k norms and rotary,
the gated activation.

Two implementations behind one interface, chosen once per model: `TorchElementwise`, torch
ops in each reference's order (any device, every family), and `FusedElementwise`, one C++
call each from `llmserve_kernels.cpu` on the CPU (every family but those with the features
`arch.fused_blockers` names). Both round every intermediate result to the model dtype where
the reference does, so float32 greedy output matches transformers either way.
"""

from __future__ import annotations

import torch

from llmserve_kernels.cpu import ops as cpu_ops
from worker_service.models.arch import ModelArchConfig
from worker_service.models.blocks import gated_activation, rms_norm
from worker_service.models.rope import apply_rotary
from worker_service.models.weights import LayerWeights

# One (cos, sin) table pair per rotary spec: [max_positions, rotary_dim] each.
RopeTables = list[tuple[torch.Tensor, torch.Tensor]]


class TorchElementwise:
    """The elementwise steps as torch ops."""

    fused = False

    def __init__(self, arch: ModelArchConfig, rope_tables: RopeTables) -> None:
        self.arch = arch
        self.rope_tables = rope_tables
        # Per rotary table, this step's cos/sin rows ([num_tokens, 1, rotary_dim] each).
        self._rotations: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin_step(self, positions: torch.Tensor) -> None:  # [num_tokens] int64
        """Gathers this step's rotary rows."""
        self._rotations = [
            (cos[positions][:, None, :], sin[positions][:, None, :])
            for cos, sin in self.rope_tables
        ]

    def add_norm(
        self,
        delta: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream
        weight: torch.Tensor | None,  # [hidden]; None: no norm here (OLMo 2)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + delta), and x + delta
        if delta is not None:
            x = x + delta
        if weight is None:
            return x, x
        return self.norm(x, weight), x

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        return rms_norm(x, weight, self.arch.rms_norm_eps, self.arch.norm)

    def queries_keys(
        self,
        qkv: torch.Tensor,  # [num_tokens, qkv width]: q, then k, lead each row
        weights: LayerWeights,
        rope: int | None,  # the layer's rotary table; None: NoPE
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [n, heads, head_dim], k [n, kv heads, head_dim]
        """The layer's queries and keys, normalized (its q/k norms) and rotated."""
        arch, n = self.arch, qkv.shape[0]
        q_size, kv_size = arch.num_heads * head_dim, num_kv_heads * head_dim
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        if arch.qk_norm == "full":
            q, k = self._qk_norms(q, k, weights)
        q, k = q.view(n, arch.num_heads, head_dim), k.view(n, num_kv_heads, head_dim)
        if arch.qk_norm == "head":
            q, k = self._qk_norms(q, k, weights)
        if rope is not None:
            cos, sin = self._rotations[rope]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k

    def queries(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        weights: LayerWeights,
        rope: int | None,
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        """The queries of a layer that reads another layer's K/V (a per-head q norm only)."""
        if weights.q_norm is not None:
            q = rms_norm(q, weights.q_norm, self.arch.rms_norm_eps, self.arch.norm)
        if rope is not None:
            q = apply_rotary(q, *self._rotations[rope])
        return q

    def gated_activation(
        self, gate_up: torch.Tensor
    ) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        return gated_activation(gate_up, self.arch.activation)

    def _qk_norms(
        self, q: torch.Tensor, k: torch.Tensor, weights: LayerWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert weights.q_norm is not None and weights.k_norm is not None
        eps, kind = self.arch.rms_norm_eps, self.arch.norm
        return rms_norm(q, weights.q_norm, eps, kind), rms_norm(k, weights.k_norm, eps, kind)


class FusedElementwise:
    """The elementwise steps as the fused C++ ops (`llmserve_kernels.cpu.ops`), called unchecked:
    the model makes their inputs from its own weights, and `begin_step` checks the positions
    (for the native decode step too, which the decoder runs after it)."""

    fused = True

    def __init__(self, arch: ModelArchConfig, rope_tables: RopeTables) -> None:
        blockers = arch.fused_blockers()
        if blockers:
            raise ValueError(f"the fused CPU ops cannot run {', '.join(blockers)}")
        self.arch = arch
        self.rope_tables = rope_tables
        self._positions = torch.empty(0, dtype=torch.int64)

    def begin_step(self, positions: torch.Tensor) -> None:  # [num_tokens] int64
        """Checks once per step what the unchecked calls rely on: the rotary tables cover
        every position, given as a contiguous int64 vector."""
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise ValueError("positions: expected a vector of int64")
        if not positions.is_contiguous():
            raise ValueError("positions: must be contiguous")
        cpu_ops.check_positions(positions, self.rope_tables[0][0].shape[0])
        self._positions = positions

    def add_norm(
        self,
        delta: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream
        weight: torch.Tensor | None,  # [hidden]; None: no norm here (OLMo 2)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + delta), and x + delta
        if weight is None:
            x = x if delta is None else x + delta
            return x, x
        eps, kind = self.arch.rms_norm_eps, self.arch.norm
        if delta is None:
            return cpu_ops.rms_norm(x, weight, eps, kind=kind, check=False), x
        # x += delta in place (x is the model's own residual stream)
        return cpu_ops.rms_norm(delta, weight, eps, residual=x, kind=kind, check=False), x

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        return cpu_ops.rms_norm(x, weight, self.arch.rms_norm_eps, kind=self.arch.norm, check=False)

    def queries_keys(
        self,
        qkv: torch.Tensor,  # [num_tokens, qkv width]: q, then k, lead each row
        weights: LayerWeights,
        rope: int | None,  # the layer's rotary table; None: NoPE
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [n, heads, head_dim], k [n, kv heads, head_dim]
        """The layer's queries and keys, normalized and rotated in place on qkv's rows (the
        projection's own output)."""
        arch, n = self.arch, qkv.shape[0]
        q_size, kv_size = arch.num_heads * head_dim, num_kv_heads * head_dim
        if arch.qk_norm is not None:
            assert weights.q_norm is not None and weights.k_norm is not None
            per_head = arch.qk_norm == "head"
            eps, kind = arch.rms_norm_eps, arch.norm
            q_heads, k_heads = (arch.num_heads, num_kv_heads) if per_head else (1, 1)
            cpu_ops.head_norm_(qkv, weights.q_norm, eps, q_heads, kind=kind, check=False)
            keys = qkv[:, q_size:]
            cpu_ops.head_norm_(keys, weights.k_norm, eps, k_heads, kind=kind, check=False)
        if rope is not None:
            cos, sin = self.rope_tables[rope]
            heads = arch.num_heads + num_kv_heads
            cpu_ops.rotary_(qkv, self._positions, cos, sin, heads, head_dim=head_dim, check=False)
        q = qkv[:, :q_size].view(n, arch.num_heads, head_dim)
        return q, qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)

    def gated_activation(
        self, gate_up: torch.Tensor
    ) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        if self.arch.activation == "silu":
            return cpu_ops.silu_mul(gate_up, check=False)
        return cpu_ops.gelu_tanh_mul(gate_up, check=False)


Elementwise = TorchElementwise | FusedElementwise


def elementwise_ops(arch: ModelArchConfig, rope_tables: RopeTables, fused: bool) -> Elementwise:
    """The fused ops where asked for and the family allows them, else torch's."""
    if fused and not arch.fused_blockers():
        return FusedElementwise(arch, rope_tables)
    return TorchElementwise(arch, rope_tables)
