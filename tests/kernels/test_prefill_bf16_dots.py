"""The prefill kernel's bfloat16 dot products (`prefill_attention(bf16_dots=True)`, fast mode's
prompts): against the torch reference on operands rounded to bfloat16, and fp32 where the CPU
has no AVX512-BF16 (the AVX2 build of test_kernel_isa.py runs this file too).

Caches are `make_paged_cache`'s poisoned ones (NaN wherever no sequence owns a slot), so a
key or value read from outside a context shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels import reference
from tests.kernels.paged import LAYOUTS, assert_unchanged_outside, make_prefill_args

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (num_heads, num_kv_heads, head_dim): SmolLM2's GQA 3:1, Gemma 3's MQA at 256, MHA, odd sizes.
SHAPES = [(9, 3, 64), (4, 1, 256), (4, 4, 32), (6, 2, 96), (2, 2, 16)]
OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param({"sliding_window": 20}, id="window"),
    pytest.param({"softcap": 5.0}, id="softcap"),
    pytest.param({"sinks": True}, id="sinks"),
]
# (cached prefix, new tokens): prompts that straddle the 32-token query tiles and the 64-key
# chunks (an odd number of keys leaves a pair half empty), chunks after a prefix hit, one
# token, a long prompt.
PARTS = [(0, 37), (48, 16), (5, 1), (100, 70), (0, 1), (16, 33), (0, 301)]
# A softmax weight rounded to bfloat16 is off by at most 2^-9 of itself, and the weights of a
# row sum to 1: the output moves by at most 2^-9 times the largest value magnitude (about 4.5
# for these standard normal caches), so 1e-2 bounds it with room; a misplaced key or value
# moves it by the size of a value.
TOLERANCE = 1e-2


def _case(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, pool_pad: int | None
) -> tuple[tuple[torch.Tensor, ...], float]:
    args = make_prefill_args(
        PARTS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        generator=torch.Generator().manual_seed(head_dim * 7 + num_heads),
        pool_pad=pool_pad,
    )
    return args, head_dim**-0.5


def _options(options: dict[str, object], num_heads: int) -> dict[str, object]:
    if options.get("sinks"):
        return {"sinks": torch.linspace(-1.0, 2.0, num_heads)}
    return options


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_bf16_dots_match_the_reference_on_rounded_operands(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pool_pad: int | None,
    options: dict[str, object],
) -> None:
    # The two tests split by CPU: exactly one of them runs on any machine (the AVX2 build of
    # test_kernel_isa.py runs the other one on an AVX512-BF16 CPU).
    if not cpu_kernels.has_bf16_dots():
        pytest.skip("no AVX512-BF16 here: bf16_dots is fp32 (the test below)")
    args, scale = _case(dtype, num_heads, num_kv_heads, head_dim, pool_pad)
    opts = _options(options, num_heads)
    query, key_cache, value_cache, *tables = args
    out = torch.full(query.shape, float("nan"), dtype=dtype)
    got = cpu_kernels.prefill_attention(*args, scale, out=out, bf16_dots=True, **opts)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    # The kernel scales the queries before rounding them; the reference's scale is then 1.
    expected = reference.prefill_attention(
        rounded(query.float() * scale), rounded(key_cache), rounded(value_cache), *tables, 1.0,
        **opts,
    )  # fmt: skip
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE, rtol=TOLERANCE)
    # Not the fp32 kernel under another name: the roundings show.
    assert not torch.equal(got, cpu_kernels.prefill_attention(*args, scale, **opts))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_dots_are_fp32_where_the_cpu_has_no_avx512_bf16(dtype: torch.dtype) -> None:
    # The other half of the split above: where the instruction exists, the flag rounds.
    if cpu_kernels.has_bf16_dots():
        pytest.skip("this CPU has AVX512-BF16 (the test above)")
    args, scale = _case(dtype, 9, 3, 64, None)
    assert torch.equal(
        cpu_kernels.prefill_attention(*args, scale, bf16_dots=True),
        cpu_kernels.prefill_attention(*args, scale),
    )


def test_bf16_dots_write_only_their_rows() -> None:
    """The kernel writes the rows of `out` it is given and nothing past them (a view of a
    larger output, as the backend passes the prefill part of a mixed step)."""
    args, scale = _case(torch.float32, 9, 3, 64, None)
    query = args[0]
    whole = torch.full((query.shape[0] + 5, *query.shape[1:]), 7.0)
    before = whole.clone()
    rows = whole[: query.shape[0]]
    cpu_kernels.prefill_attention(*args, scale, out=rows, bf16_dots=True)
    assert_unchanged_outside(before, whole, rows)
    assert rows.isfinite().all()
