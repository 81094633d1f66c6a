"""The Triton weight-only matmul (llmserve_kernels/quant_matmul.py) against the torch product of the
weights dequantized in float64: int8 and int4 with group scales (groups smaller than, equal to
and larger than the K tile, the case a per-tile scale gets wrong), GGUF Q8_0 / Q4_0 / Q4_1
blocks from the gguf package's quantizer and random Q4_K super-blocks (K tiles smaller than,
equal to and larger than 256) against the package's dequantizer, split-K, a K tail shorter
than a tile. On CPU under the Triton interpreter (conftest.py), on CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.quant_matmul import QuantFormat, quant_matmul

N = 48


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int_weights(fmt: QuantFormat, k: int, group: int, seed: int):
    """(qweight, scales, zeros, the dequantized weight [N, K] float64). Scales alternate by
    three orders of magnitude from group to group, so a scale read for the wrong group shows."""
    gen = _gen(seed)
    groups = k // group
    scales = torch.rand(N, groups, generator=gen) * 0.01 + 0.001
    scales[:, 1::2] *= 1000
    if fmt == QuantFormat.INT8:
        q = torch.randint(-127, 128, (N, k), generator=gen, dtype=torch.int8)
        dense = q.double() * scales.double().repeat_interleave(group, dim=1)
        return q, scales, None, dense
    q = torch.randint(0, 16, (N, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (N, groups), generator=gen).float()
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    dense = (q.double() - zeros.double().repeat_interleave(group, dim=1)) * scales.double(
    ).repeat_interleave(group, dim=1)  # fmt: skip
    return packed, scales, zeros, dense


def check(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    expected = x.double().cpu() @ dense.T
    scale = x.double().abs().cpu() @ dense.abs().T
    tolerance = 1e-5 if x.dtype == torch.float32 else 2e-3
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert ((out.double().cpu() - expected).abs() <= tolerance * scale + 1e-6).all()


@pytest.mark.parametrize("fmt", [QuantFormat.INT8, QuantFormat.INT4])
@pytest.mark.parametrize(("group", "block_k"), [(32, 128), (64, 64), (128, 32)])
@pytest.mark.parametrize(("m", "split_k"), [(1, 4), (5, 1), (33, None)])
def test_grouped_int_weights(device, fmt, group, block_k, m, split_k) -> None:
    k = 256
    qweight, scales, zeros, dense = int_weights(fmt, k, group, seed=group + m)
    x = torch.randn(m, k, generator=_gen(m))
    out = quant_matmul(
        x.to(device), qweight.to(device), fmt, scales.to(device),
        None if zeros is None else zeros.to(device), group=group, split_k=split_k,
        block_k=block_k,
    )  # fmt: skip
    check(out, x, dense)


GGUF = {
    QuantFormat.Q8_0: GGMLQuantizationType.Q8_0,
    QuantFormat.Q4_0: GGMLQuantizationType.Q4_0,
    QuantFormat.Q4_1: GGMLQuantizationType.Q4_1,
}


@pytest.mark.parametrize("fmt", list(GGUF))
@pytest.mark.parametrize(("m", "k", "split_k"), [(1, 320, 4), (7, 96, 1), (20, 256, 2)])
def test_gguf_blocks_dequantized_in_the_kernel(device, fmt, m, k, split_k) -> None:
    """K of 96 and 320: a last tile of 32 weights under BLOCK_K = 64, masked."""
    rng = np.random.default_rng(k + m)
    weights = (rng.standard_normal((N, k)) * 0.05).astype(np.float32)
    blocks = quantize(weights, GGUF[fmt])
    dense = torch.from_numpy(dequantize(blocks, GGUF[fmt])).double()
    x = torch.randn(m, k, generator=_gen(k))
    out = quant_matmul(x.to(device), torch.from_numpy(blocks).to(device), fmt, split_k=split_k)
    check(out, x, dense)


def q4_k_blocks(k: int, seed: int) -> np.ndarray:
    """Random valid Q4_K rows [N, K / 256 * 144] uint8 (the gguf package cannot quantize Q4_K
    in numpy): any bytes are a valid super-block once d and dmin are finite. d and dmin are
    100x larger in odd super-blocks, so a weight read from the wrong super-block shows."""
    rng = np.random.default_rng(seed)
    supers = k // 256
    d = rng.uniform(1e-4, 1e-3, (N, supers, 2))
    d[:, 1::2] *= 100
    rest = rng.integers(0, 256, (N, supers, 140), dtype=np.uint8)  # scales (12), nibbles (128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), rest], axis=-1)
    return blocks.reshape(N, supers * 144)


@pytest.mark.parametrize(
    ("m", "k", "split_k", "block_k"),
    [(1, 768, 4, 64), (5, 768, 1, 256), (3, 768, 2, 512), (20, 512, 2, 32)],
)
def test_q4_k_super_blocks_dequantized_in_the_kernel(device, m, k, split_k, block_k) -> None:
    """BLOCK_K of 32 and 64 read one super-block over several tiles, 512 two per tile (and a
    masked half tile at K = 768); split-K starts splits inside super-blocks."""
    blocks = q4_k_blocks(k, seed=k + m)
    dense = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K)).double()
    x = torch.randn(m, k, generator=_gen(m))
    out = quant_matmul(x.to(device), torch.from_numpy(blocks).to(device), QuantFormat.Q4_K,
                       split_k=split_k, block_k=block_k)  # fmt: skip
    check(out, x, dense)


def test_half_precision_activations(device) -> None:
    qweight, scales, zeros, dense = int_weights(QuantFormat.INT4, 128, 32, seed=3)
    x = torch.randn(4, 128, generator=_gen(4)).half()
    out = quant_matmul(x.to(device), qweight.to(device), QuantFormat.INT4, scales.to(device),
                       zeros.to(device), group=32)  # fmt: skip
    check(out, x, dense)


def test_bad_arguments_name_what_is_wrong() -> None:
    qweight, scales, zeros, _ = int_weights(QuantFormat.INT4, 128, 32, seed=1)
    x = torch.randn(2, 128)
    with pytest.raises(KernelArgumentError, match="zeros"):
        quant_matmul(x, qweight, QuantFormat.INT4, scales, None, group=32)
    with pytest.raises(KernelArgumentError, match="group"):
        quant_matmul(x, qweight, QuantFormat.INT4, scales, zeros, group=48)
    with pytest.raises(KernelArgumentError, match="scales"):
        quant_matmul(x, qweight, QuantFormat.INT4, scales[:, :2].contiguous(), zeros, group=32)
    with pytest.raises(KernelArgumentError, match="qweight"):
        quant_matmul(x, qweight, QuantFormat.Q4_0)  # int4 rows are not Q4_0 blocks
    with pytest.raises(KernelArgumentError, match="qweight"):
        quant_matmul(x, torch.zeros(N, 72, dtype=torch.uint8), QuantFormat.Q4_K)  # K < 256
    with pytest.raises(KernelArgumentError, match="split_k"):
        quant_matmul(x, qweight, QuantFormat.INT4, scales, zeros, group=32, split_k=0)
