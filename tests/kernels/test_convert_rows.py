"""llmserve_kernels.cpu.convert_rows against torch's casts between float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.cpu import convert_rows


def awkward_floats(rows: int, cols: int) -> torch.Tensor:
    """Random values with the cases a rounding gets wrong: ties to even either way, values
    that round up into the next binade, infinities, NaNs, signed zeros, subnormals."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 5
    bits = x.view(torch.int32)
    bits[0, :8] = (bits[0, :8] & ~0xFFFF) | 0x8000  # exact ties between two bfloat16s
    bits[0, 8:16] = (bits[0, 8:16] & ~0x1FFFF) | 0x18000  # ties whose even neighbour is up
    x[1, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 1e-40])
    x[1, 6] = 3.3895313892515355e38  # rounds up to infinity
    return x


@pytest.mark.parametrize("cols", [16, 37, 576])
def test_float32_rows_round_to_bfloat16_as_torch_casts_them(cols: int) -> None:
    """Rows of a wider tensor (a QKV projection's q, k or v part), whole vectors and a tail."""
    wide = awkward_floats(5, 2 * cols + 3)
    part = wide[:, cols : 2 * cols]  # rows 2 * cols + 3 elements apart
    got = convert_rows(part, torch.bfloat16)
    expected = part.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == part.shape
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # NaNs' bits too


def test_bfloat16_rows_widen_exactly_and_a_3d_view_keeps_its_shape() -> None:
    x = awkward_floats(64, 3 * 192).to(torch.bfloat16).view(64, 3, 192)[:, 1:, :]  # [64, 2, 192]
    got = convert_rows(x, torch.float32)
    assert got.shape == (64, 2, 192) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), x.float().isnan())
    assert torch.equal(got.nan_to_num(), x.float().nan_to_num())
    assert convert_rows(torch.empty(0, 4), torch.bfloat16).shape == (0, 4)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(KernelArgumentError, match="dtype"):
        convert_rows(torch.zeros(2, 16), torch.float32)
    with pytest.raises(KernelArgumentError, match="dtype"):
        convert_rows(torch.zeros(2, 16), torch.float16)
    with pytest.raises(KernelArgumentError, match="x"):
        convert_rows(torch.zeros(2, 16, 4)[:, :, :2], torch.bfloat16)
