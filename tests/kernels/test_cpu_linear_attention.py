"""The C++ decode steps of a Gated DeltaNet layer's states (llmserve_kernels.cpu) against the torch
references: the conv update and one step of the gated delta rule, in shuffled pool slots."""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels import KernelArgumentError
from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels.causal_conv1d import causal_conv1d_update
from llmserve_kernels.gated_delta_rule import gated_delta_rule_decode
from tests.kernels.linear_state import make_delta_inputs, make_state_pool, slots

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Outputs: float32 agrees to summation order; bfloat16 outputs to one rounding.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
STATE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
SLOTS = [5, 0, 3, 7, 1]  # five sequences in a pool of 8; slots 2, 4, 6 stay untouched


@pytest.mark.parametrize("dtype", DTYPES)
# Channels in one work item, several (1100 > 512: the blocks after the first), a tail.
@pytest.mark.parametrize(
    ("dim", "kernel_size"), [(12, 4), (300, 4), (1100, 4), (17, 2), (8, 5), (40, 9)]
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_update_matches_reference(
    dtype: torch.dtype, dim: int, kernel_size: int, with_bias: bool, activation: str | None
) -> None:
    gen = torch.Generator().manual_seed(dim + kernel_size)
    weight = (torch.randn(dim, kernel_size, generator=gen) / kernel_size).to(dtype)
    bias = torch.randn(dim, generator=gen).to(dtype) if with_bias else None
    pool = make_state_pool(8, kernel_size - 1, dim, generator=gen, dtype=dtype)
    expected_pool = pool.clone()
    for _ in range(3):  # three steps: the slots shift and are read back
        x = torch.randn(len(SLOTS), dim, generator=gen).to(dtype)
        args = (weight, bias, slots(SLOTS), activation)
        out = cpu_kernels.causal_conv1d_update(x, pool, *args)  # type: ignore[arg-type]
        expected = causal_conv1d_update(x, expected_pool, *args)  # type: ignore[arg-type]
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
        assert torch.equal(pool, expected_pool)  # kept inputs are copied, never rounded


def test_conv1d_update_reads_weight_laid_out_by_tap() -> None:
    """A weight kept tap by tap ([kernel_size, dim]) and passed as its transposed view."""
    gen = torch.Generator().manual_seed(9)
    taps = torch.randn(4, 40, generator=gen)
    pool = make_state_pool(8, 3, 40, generator=gen)
    expected_pool = pool.clone()
    x = torch.randn(len(SLOTS), 40, generator=gen)
    out = cpu_kernels.causal_conv1d_update(x, pool, taps.t(), None, slots(SLOTS))
    expected = causal_conv1d_update(x, expected_pool, taps.t().contiguous(), None, slots(SLOTS))
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    assert torch.equal(pool, expected_pool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "k_dim", "v_dim"),
    # Qwen3.5's heads (128 x 128, three value heads per key head), odd sizes that leave a
    # vector tail, one head, k_dim != v_dim.
    [(2, 6, 128, 128), (1, 1, 8, 8), (2, 4, 16, 24), (3, 3, 20, 13), (1, 2, 64, 32)],
)
@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_delta_decode_matches_reference(
    dtype: torch.dtype, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, qk_l2norm: bool
) -> None:
    gen = torch.Generator().manual_seed(k_dim * v_dim + num_v_heads)
    pool = make_state_pool(8, num_v_heads, k_dim, v_dim, generator=gen)
    expected_pool = pool.clone()
    scale = None if qk_l2norm else 0.05  # unnormalised keys would make the state grow
    for _ in range(3):
        inputs = make_delta_inputs(len(SLOTS), num_k_heads, num_v_heads, k_dim, v_dim, gen, dtype)
        if not qk_l2norm:
            inputs.k = (inputs.k.float() / k_dim**0.5).to(dtype)
        args = (*inputs.tensors(),)
        kwargs = dict(scale=scale, qk_l2norm=qk_l2norm)
        out = cpu_kernels.gated_delta_rule_decode(*args, pool, slots(SLOTS), **kwargs)  # type: ignore[arg-type]
        expected = gated_delta_rule_decode(*args, expected_pool, slots(SLOTS), **kwargs)  # type: ignore[arg-type]
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(pool, expected_pool, **STATE_TOLERANCE)
    assert torch.equal(pool[[2, 4, 6]], expected_pool[[2, 4, 6]])


def test_delta_decode_reads_strided_rows() -> None:
    """q, k and v as views into the conv's output row, as the layer splits it."""
    gen = torch.Generator().manual_seed(2)
    num_k_heads, num_v_heads, k_dim, v_dim = 2, 4, 16, 8
    key_width = num_k_heads * k_dim
    mixed = torch.randn(len(SLOTS), 2 * key_width + num_v_heads * v_dim, generator=gen)
    q, k, v = mixed.split([key_width, key_width, num_v_heads * v_dim], dim=1)
    q, k, v = (
        q.view(-1, num_k_heads, k_dim),
        k.view(-1, num_k_heads, k_dim),
        v.view(-1, num_v_heads, v_dim),
    )
    g = -torch.rand(len(SLOTS), num_v_heads, generator=gen)
    beta = torch.rand(len(SLOTS), num_v_heads, generator=gen).to(torch.bfloat16)  # cast inside
    pool = make_state_pool(8, num_v_heads, k_dim, v_dim, generator=gen)
    expected_pool = pool.clone()
    out = cpu_kernels.gated_delta_rule_decode(q, k, v, g, beta, pool, slots(SLOTS))
    expected = gated_delta_rule_decode(
        q.contiguous(), k.contiguous(), v.contiguous(), g, beta, expected_pool, slots(SLOTS)
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(pool, expected_pool, **STATE_TOLERANCE)


def test_argument_errors_name_the_argument() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = make_delta_inputs(2, 1, 1, 8, 8, gen)
    pool = make_state_pool(3, 1, 8, 8, generator=gen)
    cases = [
        (dict(state=pool.to(torch.bfloat16)), "state"),
        (dict(state_slots=slots([0, 0])), "state_slots"),
        (dict(v=inputs.v.repeat(1, 1, 2)[:, :, ::2]), "v"),  # every other element
    ]
    for change, name in cases:
        args = dict(
            q=inputs.q,
            k=inputs.k,
            v=inputs.v,
            g=inputs.g,
            beta=inputs.beta,
            state=pool,
            state_slots=slots([0, 2]),
        )
        args.update(change)
        with pytest.raises(KernelArgumentError) as error:
            cpu_kernels.gated_delta_rule_decode(**args)  # type: ignore[arg-type]
        assert error.value.name == name
    x, conv_state = torch.zeros(2, 4), torch.zeros(3, 3, 4)
    weight = torch.zeros(4, 4, dtype=torch.bfloat16)  # not x's dtype
    with pytest.raises(KernelArgumentError) as error:
        cpu_kernels.causal_conv1d_update(x, conv_state, weight, None, slots([0, 1]))
    assert error.value.name == "weight"
