"""The gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next): torch references.

Per value head, the layer keeps a matrix S [k_dim, v_dim] that maps keys to values. Token t
first decays it, S <- exp(g_t) S, then moves the value S reads for its key toward its own
value by a step beta_t, S <- S + k_t (beta_t (v_t - S^T k_t))^T, and reads its output with
its query, o_t = S^T q_t. q and k are L2-normalised first and q is scaled by k_dim^-1/2, as
Qwen3.5's layer asks of its kernel. Key heads may be fewer than value heads: value head h
uses key head h // (num_v_heads // num_k_heads).

Three forms of the same rule, each checked against the others by the tests:
- `gated_delta_rule_recurrent`: token by token, for decode and short chunks;
- `gated_delta_rule_chunked`: a chunk of C tokens at a time in matrix products (prefill);
- `gated_delta_rule_decode`: one token per sequence, the whole batch at once.

States live in a pool `[num_slots, num_v_heads, k_dim, v_dim]`, one slot per sequence, read
and written in place: after a call, a sequence's slot holds the state after its last token.
Sequences are packed one after another (`query_start_loc`), so one call runs prefill chunks
and decode tokens together. Arithmetic is float32; outputs take v's dtype, states the pool's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve_kernels._checks import (
    FLOAT_DTYPES,
    KernelArgumentError,
    check_dim,
    check_dtype,
    check_has_initial_state,
    check_ndim,
    check_query_start_loc,
    check_same_dtype,
    check_state_slots,
)

# Added to |x|^2 under the square root of the L2 normalisation, as the layer's kernels do.
L2_NORM_EPS = 1e-6


def gated_delta_gates(
    a: torch.Tensor,  # [num_tokens, num_v_heads]: the layer's in_proj_a output
    b: torch.Tensor,  # [num_tokens, num_v_heads]: the layer's in_proj_b output
    a_log: torch.Tensor,  # [num_v_heads]: the layer's A_log
    dt_bias: torch.Tensor,  # [num_v_heads]
) -> tuple[torch.Tensor, torch.Tensor]:  # g, beta: [num_tokens, num_v_heads] each
    """The log-decay g = -exp(A_log) softplus(a + dt_bias) in float32 and the step
    beta = sigmoid(b) in b's dtype (where transformers' layer rounds it; the rule upcasts)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def gated_delta_rule_recurrent(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_dim], sequences back to back
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads]: log of each token's decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    state_slots: torch.Tensor,  # [num_seqs] int32
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    *,
    scale: float | None = None,  # None: k_dim ** -0.5
    qk_l2norm: bool = True,
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_dim]
    """The rule token by token. A slot whose has_initial_state is False starts from zeros;
    a sequence of no tokens leaves its slot alone."""
    batch = _prepare(q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state)
    out = torch.empty_like(v)
    for seq in batch.sequences():
        q_s, k_s, v_s, g_s, beta_s = batch.tokens(seq, scale, qk_l2norm)
        s = batch.initial_state(seq)  # [heads, k_dim, v_dim]
        for t in range(v_s.shape[1]):
            s = s * g_s[:, t].exp()[:, None, None]
            read = torch.einsum("hkv,hk->hv", s, k_s[:, t])  # [heads, v_dim]
            step = beta_s[:, t, None] * (v_s[:, t] - read)
            s = s + k_s[:, t, :, None] * step[:, None, :]
            out[batch.starts[seq] + t] = torch.einsum("hkv,hk->hv", s, q_s[:, t]).to(out.dtype)
        batch.store_state(seq, s)
    return out


def gated_delta_rule_chunked(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_dim], sequences back to back
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads]: log of each token's decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    state_slots: torch.Tensor,  # [num_seqs] int32
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    *,
    scale: float | None = None,  # None: k_dim ** -0.5
    qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_dim]
    """The same rule as `gated_delta_rule_recurrent`, chunk_size tokens at a time (the last
    chunk of a sequence may be shorter)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise KernelArgumentError("chunk_size", f"must be a positive integer, got {chunk_size!r}")
    batch = _prepare(q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state)
    out = torch.empty_like(v)
    for seq in batch.sequences():
        q_s, k_s, v_s, g_s, beta_s = batch.tokens(seq, scale, qk_l2norm)
        s = batch.initial_state(seq)
        for first in range(0, v_s.shape[1], chunk_size):
            chunk = slice(first, first + chunk_size)
            o, s = _chunk(
                q_s[:, chunk], k_s[:, chunk], v_s[:, chunk], g_s[:, chunk], beta_s[:, chunk], s
            )
            begin = batch.starts[seq] + first
            out[begin : begin + o.shape[1]] = o.transpose(0, 1).to(out.dtype)
        batch.store_state(seq, s)
    return out


def gated_delta_rule_decode(
    q: torch.Tensor,  # [num_seqs, num_k_heads, k_dim]: one token per sequence
    k: torch.Tensor,  # [num_seqs, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_seqs, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_seqs, num_v_heads]
    beta: torch.Tensor,  # [num_seqs, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated in place
    state_slots: torch.Tensor,  # [num_seqs] int32
    *,
    scale: float | None = None,  # None: k_dim ** -0.5
    qk_l2norm: bool = True,
) -> torch.Tensor:  # [num_seqs, num_v_heads, v_dim]
    """One step of the rule for every sequence at once, every slot holding a state."""
    check_delta_rule_args(q, k, v, g, beta, state)
    slots = check_state_slots(state_slots, v.shape[0], state.shape[0])
    q32, k32 = _normalized(q, k, v.shape[1], scale, qk_l2norm)  # [num_seqs, num_v_heads, k_dim]
    index = torch.tensor(slots, dtype=torch.long, device=v.device)
    s = state[index].float() * g.float().exp()[:, :, None, None]  # [seqs, heads, k_dim, v_dim]
    read = torch.einsum("shkv,shk->shv", s, k32)
    step = beta.float()[:, :, None] * (v.float() - read)
    s = s + k32[..., :, None] * step[..., None, :]
    state[index] = s.to(state.dtype)
    return torch.einsum("shkv,shk->shv", s, q32).to(v.dtype)


def _chunk(
    q: torch.Tensor,  # [heads, c, k_dim], normalised and scaled
    k: torch.Tensor,  # [heads, c, k_dim], normalised
    v: torch.Tensor,  # [heads, c, v_dim]
    g: torch.Tensor,  # [heads, c]
    beta: torch.Tensor,  # [heads, c]
    s: torch.Tensor,  # [heads, k_dim, v_dim]: the state before the chunk
) -> tuple[torch.Tensor, torch.Tensor]:  # outputs [heads, c, v_dim], the state after it
    """One chunk in matrix products.

    With G_i the sum of g over tokens 0..i of the chunk and S0 its first state, token i's
    state unrolls to S_i = e^G_i S0 + sum_{j<=i} e^(G_i - G_j) k_j u_j^T, where u_j is token
    j's step beta_j (v_j - S'^T k_j) (S' the state decayed just before token j). Writing the
    steps with that sum gives a unit lower-triangular system for the u of the chunk:
    u_i + sum_{j<i} beta_i e^(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - e^G_i S0^T k_i).
    Outputs and the last state then follow from the unrolled S_i in two products each.
    """
    length = v.shape[1]
    cum = g.cumsum(dim=1)  # [heads, c]: G
    later = torch.ones(length, length, dtype=torch.bool, device=v.device).triu(1)
    # [heads, c, c]: e^(G_i - G_j) where j <= i, 0 where j comes after i
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(later, float("-inf")).exp()
    keys = k @ k.transpose(1, 2)  # [heads, c, c]
    system = (beta[:, :, None] * keys * decay).tril(-1)
    system = system + torch.eye(length, device=v.device)
    target = beta[:, :, None] * (v - (k * cum.exp()[:, :, None]) @ s)  # [heads, c, v_dim]
    u = torch.linalg.solve_triangular(system, target, upper=False, unitriangular=True)
    out = (q * cum.exp()[:, :, None]) @ s + ((q @ k.transpose(1, 2)) * decay) @ u
    to_end = (cum[:, -1:] - cum).exp()  # [heads, c]: e^(G_last - G_j)
    s = cum[:, -1].exp()[:, None, None] * s + (k * to_end[:, :, None]).transpose(1, 2) @ u
    return out, s


@dataclass
class _Batch:
    """A validated call: the packed tensors, the pool, each sequence's offsets and slot."""

    q: torch.Tensor  # [num_tokens, num_k_heads, k_dim]
    k: torch.Tensor  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor  # [num_tokens, num_v_heads]
    beta: torch.Tensor  # [num_tokens, num_v_heads]
    state: torch.Tensor  # [num_slots, num_v_heads, k_dim, v_dim]
    starts: list[int]  # num_seqs + 1 offsets
    slots: list[int]  # num_seqs
    initial: list[bool]  # num_seqs

    def sequences(self) -> list[int]:
        """The sequences with tokens in this call."""
        return [seq for seq in range(len(self.slots)) if self.starts[seq + 1] > self.starts[seq]]

    def tokens(self, seq: int, scale: float | None, qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
        """Sequence seq's q, k [heads, len, k_dim], v [heads, len, v_dim], g, beta
        [heads, len], in float32, per value head, q and k normalised and q scaled."""
        part = slice(self.starts[seq], self.starts[seq + 1])
        q, k = _normalized(self.q[part], self.k[part], self.v.shape[1], scale, qk_l2norm)
        v, g, beta = (x[part].float() for x in (self.v, self.g, self.beta))
        return tuple(x.transpose(0, 1) for x in (q, k, v, g, beta))

    def initial_state(self, seq: int) -> torch.Tensor:  # [num_v_heads, k_dim, v_dim] float32
        s = self.state[self.slots[seq]].float()
        return s if self.initial[seq] else torch.zeros_like(s)

    def store_state(self, seq: int, s: torch.Tensor) -> None:
        self.state[self.slots[seq]] = s.to(self.state.dtype)


def _normalized(
    q: torch.Tensor,  # [len, num_k_heads, k_dim]
    k: torch.Tensor,  # [len, num_k_heads, k_dim]
    num_v_heads: int,
    scale: float | None,
    qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # q, k: [len, num_v_heads, k_dim] float32 each
    """q and k in float32, L2-normalised when asked, q scaled, repeated per value head."""
    q, k = q.float(), k.float()
    if qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + L2_NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + L2_NORM_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = num_v_heads // q.shape[1]
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> _Batch:
    check_delta_rule_args(q, k, v, g, beta, state)
    starts = check_query_start_loc(query_start_loc, q.shape[0])
    slots = check_state_slots(state_slots, len(starts) - 1, state.shape[0])
    initial = check_has_initial_state(has_initial_state, len(slots))
    return _Batch(q, k, v, g, beta, state, starts, slots, initial)


def check_delta_rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> None:
    """Validates a call's tensors (its offsets and slots are checked apart)."""
    check_ndim("q", q, 3, "[num_tokens, num_k_heads, k_dim]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("k", k, 3, "[num_tokens, num_k_heads, k_dim]")
    if k.shape != q.shape:
        raise KernelArgumentError("k", f"shape {tuple(k.shape)} differs from q {tuple(q.shape)}")
    check_same_dtype("k", k, q, "q")
    check_ndim("v", v, 3, "[num_tokens, num_v_heads, v_dim]")
    check_dim("v", v, 0, q.shape[0], "num_tokens")
    check_same_dtype("v", v, q, "q")
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise KernelArgumentError(
            "v", f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads"
        )
    for name, tensor in (("g", g), ("beta", beta)):
        check_ndim(name, tensor, 2, "[num_tokens, num_v_heads]")
        check_dim(name, tensor, 0, num_tokens, "num_tokens")
        check_dim(name, tensor, 1, num_v_heads, "num_v_heads")
        check_dtype(name, tensor, FLOAT_DTYPES)
    check_ndim("state", state, 4, "[num_slots, num_v_heads, k_dim, v_dim]")
    check_dim("state", state, 1, num_v_heads, "num_v_heads")
    check_dim("state", state, 2, k_dim, "k_dim")
    check_dim("state", state, 3, v_dim, "v_dim")
    check_dtype("state", state, FLOAT_DTYPES)
