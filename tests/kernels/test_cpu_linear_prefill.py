"""The C++ prefill of a Gated DeltaNet layer's states (llmserve_kernels.cpu, linear_prefill.cpp)
against the torch references: the packed causal conv and the gated delta rule over sequences of
mixed lengths in shuffled pool slots, some new (their slots hold NaN: never read), states carried
across calls."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llmserve_kernels import KernelArgumentError
from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels.causal_conv1d import causal_conv1d
from llmserve_kernels.gated_delta_rule import gated_delta_rule_chunked
from tests.kernels.linear_state import (
    delta_args,
    make_delta_inputs,
    make_state_pool,
    offsets,
    slots,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Outputs: float32 agrees to summation order; bfloat16 outputs to one rounding. The float32
# state is computed from the same (rounded) inputs in both, so it agrees tightly either way.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
STATE_TOLERANCE = dict(atol=2e-5, rtol=2e-5)
# A decode-like token, short, one reference chunk, two chunks and a bit, none, shorter than
# the conv's kept inputs; in a pool of 10 whose slots 2, 5 and 8 no sequence uses.
LENS = [1, 7, 64, 130, 0, 2]
SLOTS = [6, 0, 9, 3, 7, 1]
NEW = [False, True, False, True, True, False]  # fresh sequences: their slots hold NaN
UNUSED = [2, 5, 8]
# (num_k_heads, num_v_heads, k_dim, v_dim): two value heads per key head at Qwen3.5's head
# dims; one key head per value head with dims that leave a tail of state columns (13) or
# several column blocks and a tail (40); two value heads per key head, k_dim != v_dim.
HEADS = [(2, 4, 128, 128), (3, 3, 20, 13), (1, 1, 8, 40), (2, 4, 16, 24)]


def fresh_pool(pool: torch.Tensor) -> torch.Tensor:
    """The pool with NaN in the slots of new sequences."""
    pool = pool.clone()
    for slot, new in zip(SLOTS, NEW, strict=True):
        if new:
            pool[slot] = float("nan")
    return pool


def initial() -> torch.Tensor:  # [num_seqs] bool
    return torch.tensor([not new for new in NEW])


@dataclass
class Call:
    """One of the calls a test cuts a batch into."""

    rows: list[int]  # the rows of the whole batch's packed inputs it takes
    lens: list[int]  # its part of each sequence (0: none)
    has_initial_state: torch.Tensor  # [num_seqs] bool


def two_calls(cut: int) -> list[Call]:
    """The batch of LENS in two calls: each sequence's first `cut` tokens (all of a shorter
    one), then the rest, continuing from the slot the first call wrote (a sequence that was
    new and had no tokens in it is still new)."""
    firsts = [min(n, cut) for n in LENS]
    rests = [n - f for n, f in zip(LENS, firsts, strict=True)]
    starts = offsets(LENS).tolist()
    rows = [
        [starts[s] + skip[s] + i for s, n in enumerate(lens) for i in range(n)]
        for lens, skip in ((firsts, [0] * len(LENS)), (rests, firsts))
    ]
    continued = torch.tensor([not new or f > 0 for new, f in zip(NEW, firsts, strict=True)])
    return [Call(rows[0], firsts, initial()), Call(rows[1], rests, continued)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_k_heads", "num_v_heads", "k_dim", "v_dim"), HEADS)
@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_delta_prefill_matches_reference(
    dtype: torch.dtype, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, qk_l2norm: bool
) -> None:
    gen = torch.Generator().manual_seed(k_dim * v_dim + num_v_heads)
    inputs = make_delta_inputs(sum(LENS), num_k_heads, num_v_heads, k_dim, v_dim, gen, dtype)
    if not qk_l2norm:  # unnormalised keys would make the state grow
        inputs.k = (inputs.k.float() / k_dim**0.5).to(dtype)
    pool = fresh_pool(make_state_pool(10, num_v_heads, k_dim, v_dim, generator=gen))
    before = pool.clone()
    expected_pool = pool.clone()
    args = (offsets(LENS), slots(SLOTS), initial())
    kwargs = dict(scale=None if qk_l2norm else 0.05, qk_l2norm=qk_l2norm)
    out = cpu_kernels.gated_delta_rule_prefill(*inputs.tensors(), pool, *args, **kwargs)  # type: ignore[arg-type]
    expected = gated_delta_rule_chunked(*inputs.tensors(), expected_pool, *args, **kwargs)  # type: ignore[arg-type]
    assert out.dtype == dtype and pool.dtype == torch.float32
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    used = [slot for slot, n in zip(SLOTS, LENS, strict=True) if n > 0]
    torch.testing.assert_close(pool[used], expected_pool[used], **STATE_TOLERANCE)
    # The empty sequence's slot (NaN) and the unused ones are left as they were.
    empty = [slot for slot, n in zip(SLOTS, LENS, strict=True) if n == 0]
    assert torch.equal(pool[UNUSED], before[UNUSED])
    assert pool[empty].isnan().all()


@pytest.mark.parametrize("cut", [1, 50, 64, 129])
def test_delta_prefill_carries_state_across_calls(cut: int) -> None:
    """Each sequence in two calls, the second continuing from the slots the first wrote,
    gives the outputs and states of the reference's one call."""
    gen = torch.Generator().manual_seed(cut)
    inputs = make_delta_inputs(sum(LENS), 2, 4, 32, 16, gen)
    pool = fresh_pool(make_state_pool(10, 4, 32, 16, generator=gen))
    expected_pool = pool.clone()
    where = (offsets(LENS), slots(SLOTS), initial())
    expected = gated_delta_rule_chunked(*inputs.tensors(), expected_pool, *where)
    out = torch.empty_like(expected)
    for call in two_calls(cut):
        part = [x[call.rows] for x in inputs.tensors()]
        where = (offsets(call.lens), slots(SLOTS), call.has_initial_state)
        out[call.rows] = cpu_kernels.gated_delta_rule_prefill(*part, pool, *where)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    used = [slot for slot, n in zip(SLOTS, LENS, strict=True) if n > 0]
    torch.testing.assert_close(pool[used], expected_pool[used], **STATE_TOLERANCE)


def test_delta_prefill_reads_strided_rows() -> None:
    """q, k and v as views into the conv's output rows, as the layer splits them; the state
    flags left out (every slot holds a state)."""
    gen = torch.Generator().manual_seed(2)
    num_k_heads, num_v_heads, k_dim, v_dim = 2, 4, 16, 8
    key_width = num_k_heads * k_dim
    lens = [9, 70]
    mixed = torch.randn(sum(lens), 2 * key_width + num_v_heads * v_dim, generator=gen)
    q, k, v = mixed.split([key_width, key_width, num_v_heads * v_dim], dim=1)
    q, k, v = (
        q.view(-1, num_k_heads, k_dim),
        k.view(-1, num_k_heads, k_dim),
        v.view(-1, num_v_heads, v_dim),
    )
    g = -torch.rand(sum(lens), num_v_heads, generator=gen)
    beta = torch.rand(sum(lens), num_v_heads, generator=gen).to(torch.bfloat16)  # cast inside
    pool = make_state_pool(3, num_v_heads, k_dim, v_dim, generator=gen)
    expected_pool = pool.clone()
    where = (offsets(lens), slots([2, 0]))
    out = cpu_kernels.gated_delta_rule_prefill(q, k, v, g, beta, pool, *where)
    dense = (q.contiguous(), k.contiguous(), v.contiguous())
    expected = gated_delta_rule_chunked(*dense, g, beta, expected_pool, *where)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(pool, expected_pool, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
# Channels in one work item, several (1100 > 512: the blocks after the first), a tail; the
# conv kernel's sizes: Qwen3.5's 4, the smallest, and kept inputs more than some sequences.
@pytest.mark.parametrize(("dim", "kernel_size"), [(12, 4), (1100, 4), (17, 2), (40, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_matches_reference(
    dtype: torch.dtype, dim: int, kernel_size: int, with_bias: bool, activation: str | None
) -> None:
    gen = torch.Generator().manual_seed(dim + kernel_size)
    weight = (torch.randn(dim, kernel_size, generator=gen) / kernel_size).to(dtype)
    bias = torch.randn(dim, generator=gen).to(dtype) if with_bias else None
    pool = fresh_pool(make_state_pool(10, kernel_size - 1, dim, generator=gen, dtype=dtype))
    before = pool.clone()
    expected_pool = pool.clone()
    # x: every other row of a wider tensor, as the layer's projection is split.
    x = torch.randn(sum(LENS), 2 * dim, generator=gen).to(dtype)[:, :dim]
    args = (weight, bias, offsets(LENS), slots(SLOTS), initial(), activation)
    out = cpu_kernels.causal_conv1d(x, pool, *args)  # type: ignore[arg-type]
    expected = causal_conv1d(x, expected_pool, *args)  # type: ignore[arg-type]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    # Kept inputs are copied, never rounded; the empty sequence's slot keeps its NaN.
    used = [slot for slot, n in zip(SLOTS, LENS, strict=True) if n > 0]
    assert torch.equal(pool[used], expected_pool[used])
    assert torch.equal(pool[UNUSED], before[UNUSED])
    assert pool[SLOTS[LENS.index(0)]].isnan().all()


@pytest.mark.parametrize("cut", [1, 2, 5, 100])
def test_conv1d_carries_state_across_calls(cut: int) -> None:
    """Each sequence in two calls equals the reference's one call (the kept inputs bridge
    the cut, also where a part is shorter than they are)."""
    gen = torch.Generator().manual_seed(cut)
    dim, kernel_size = 24, 4
    weight = torch.randn(dim, kernel_size, generator=gen) / kernel_size
    x = torch.randn(sum(LENS), dim, generator=gen)
    pool = fresh_pool(make_state_pool(10, kernel_size - 1, dim, generator=gen))
    expected_pool = pool.clone()
    where = (offsets(LENS), slots(SLOTS), initial())
    expected = causal_conv1d(x, expected_pool, weight, None, *where)
    out = torch.empty_like(expected)
    for call in two_calls(cut):
        where = (offsets(call.lens), slots(SLOTS), call.has_initial_state)
        out[call.rows] = cpu_kernels.causal_conv1d(x[call.rows], pool, weight, None, *where)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    used = [slot for slot, n in zip(SLOTS, LENS, strict=True) if n > 0]
    assert torch.equal(pool[used], expected_pool[used])


def conv_args(**change: object) -> dict[str, object]:
    """A valid call of the packed conv (two sequences, slots 0 and 3 of 4), changed."""
    args: dict[str, object] = dict(
        x=torch.zeros(6, 8),
        conv_state=torch.zeros(4, 3, 8),
        weight=torch.zeros(8, 4),
        bias=None,
        query_start_loc=offsets([4, 2]),
        state_slots=slots([0, 3]),
        has_initial_state=torch.tensor([True, False]),
    )
    return {**args, **change}


@pytest.mark.parametrize(
    ("kernel", "args", "name"),
    [
        ("delta", delta_args(state=torch.zeros(4, 4, 16, 8, dtype=torch.bfloat16)), "state"),
        ("delta", delta_args(state_slots=slots([1, 1])), "state_slots"),
        ("delta", delta_args(query_start_loc=offsets([3, 2])), "query_start_loc"),
        (
            "delta",
            delta_args(has_initial_state=torch.ones(2, dtype=torch.int32)),
            "has_initial_state",
        ),
        ("delta", delta_args(v=torch.zeros(6, 4, 16)[:, :, ::2]), "v"),  # every other element
        ("delta", delta_args(g=torch.zeros(6, 2)), "g"),
        (
            "delta",
            delta_args(
                q=torch.zeros(6, 2, 520),
                k=torch.zeros(6, 2, 520),
                state=torch.zeros(4, 4, 520, 8),
            ),
            "q",
        ),
        ("conv", conv_args(weight=torch.zeros(8, 4, dtype=torch.bfloat16)), "weight"),
        ("conv", conv_args(x=torch.zeros(6, 16)[:, ::2]), "x"),
        ("conv", conv_args(conv_state=torch.zeros(4, 8, 3).transpose(1, 2)), "conv_state"),
        ("conv", conv_args(has_initial_state=torch.tensor([True])), "has_initial_state"),
        (
            "conv",
            conv_args(query_start_loc=torch.tensor([0, 4, 3, 6], dtype=torch.int32)),
            "query_start_loc",
        ),
    ],
)
def test_argument_errors_name_the_argument(kernel: str, args: dict[str, object], name: str) -> None:
    run = {"delta": cpu_kernels.gated_delta_rule_prefill, "conv": cpu_kernels.causal_conv1d}
    with pytest.raises(KernelArgumentError) as error:
        run[kernel](**args)  # type: ignore[operator]
    assert error.value.name == name
