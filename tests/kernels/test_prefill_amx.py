"""Fast mode's prompt attention on the matrix engine (llmserve_kernels/cpu/prefill_amx.h): with the
engine on, `prefill_attention(bf16_dots=True)` runs each key chunk's update on AMX bfloat16
tiles for head dims that are multiples of 32, and its outputs hold against the torch
reference on operands rounded to bfloat16 as the vector path's do (test_prefill_bf16_dots.py,
whose cases these are). Where no engine runs (this CPU, build or OS), the tests that need it
skip; test_amx_emulated.py runs them on a model of the tiles wherever AVX-512 runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels import reference
from llmserve_kernels.cpu import build
from tests.kernels.paged import LAYOUTS
from tests.kernels.test_prefill_bf16_dots import OPTIONS, SHAPES, TOLERANCE, _case, _options

needs_engine = pytest.mark.skipif(
    not (cpu_kernels.has_bf16_dots() and build.set_matrix_engine(None)),
    reason="no matrix engine here (CPU, build or OS)",
)


@pytest.fixture
def engine() -> Iterator[None]:
    """The test may turn the engine off; it is on again after."""
    yield
    build.set_matrix_engine(True)


def prefill(on: bool, *args: object, **options: object) -> tuple[torch.Tensor, int]:
    """The bf16-dots prefill with the engine on or off, and how many calls the tiles took."""
    build.set_matrix_engine(on)
    before = build.matrix_engine_calls("prefill")
    out = cpu_kernels.prefill_attention(*args, bf16_dots=True, **options)
    return out, build.matrix_engine_calls("prefill") - before


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@needs_engine
@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_tiles_match_the_reference_on_rounded_operands(
    engine, dtype, num_heads, num_kv_heads, head_dim, pool_pad, options
):
    args, scale = _case(dtype, num_heads, num_kv_heads, head_dim, pool_pad)
    opts = _options(options, num_heads)
    query, key_cache, value_cache, *tables = args
    on, taken = prefill(True, *args, scale, **opts)
    off, taken_off = prefill(False, *args, scale, **opts)
    assert taken == (1 if head_dim % 32 == 0 else 0)
    assert taken_off == 0
    expected = reference.prefill_attention(
        rounded(query.float() * scale), rounded(key_cache), rounded(value_cache), *tables, 1.0,
        **opts,
    )  # fmt: skip
    assert on.isfinite().all()
    torch.testing.assert_close(on.float(), expected, atol=TOLERANCE, rtol=TOLERANCE)
    if head_dim % 32:
        assert torch.equal(on, off)  # not taken: the vector path's own bits


@needs_engine
def test_tiles_write_only_their_rows(engine):
    """As the vector path: the rows of `out` it is given and nothing past them."""
    args, scale = _case(torch.float32, 9, 3, 64, None)
    query = args[0]
    whole = torch.full((query.shape[0] + 5, *query.shape[1:]), 7.0)
    rows = whole[: query.shape[0]]
    build.set_matrix_engine(True)
    cpu_kernels.prefill_attention(*args, scale, out=rows, bf16_dots=True)
    assert (whole[query.shape[0] :] == 7.0).all()
    assert rows.isfinite().all()


def test_exact_prompts_stay_off_the_tiles(engine):
    """Without bf16_dots (exact mode's fp32 attention) the engine takes nothing."""
    args, scale = _case(torch.float32, 9, 3, 64, None)
    build.set_matrix_engine(True)
    before = build.matrix_engine_calls("prefill")
    cpu_kernels.prefill_attention(*args, scale)
    assert build.matrix_engine_calls("prefill") == before
