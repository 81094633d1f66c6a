"""Weights kept in GGUF blocks (kernels.cpu.quant) against the gguf package, the reference
transformers itself dequantizes GGUF files with: dequantized weights bit for bit, and the
exact-mode linear against x @ dequantize(w).T in float64. Blocks come from the package's
own quantizer, and from SmolLM2's shipped Q4_1 file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from kernels import KernelArgumentError
from kernels.cpu import quant
from llmserve.model_spec import resolve_model

TYPES = [
    pytest.param(GGMLQuantizationType.Q4_0, id="q4_0"),
    pytest.param(GGMLQuantizationType.Q4_1, id="q4_1"),
    pytest.param(GGMLQuantizationType.Q8_0, id="q8_0"),
]


def quantized(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, cols / 32 * block bytes] uint8, from weights spread like a model's (a few
    large ones, so blocks' scales differ), quantized by the gguf package."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    weights[rng.random((rows, cols)) < 0.01] *= 40
    return quantize(weights, ggml_type)


def reference(x: torch.Tensor, blocks: np.ndarray, ggml_type: GGMLQuantizationType):
    w = torch.from_numpy(dequantize(blocks, ggml_type)).double()
    return x.double() @ w.T


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("cols", [32, 640, 896])
def test_dequantized_weights_are_the_gguf_packages_bit_for_bit(ggml_type, cols):
    blocks = quantized(ggml_type, 37, cols, seed=cols)
    ours = quant.dequantize(ggml_type, torch.from_numpy(blocks), cols)
    theirs = torch.from_numpy(dequantize(blocks, ggml_type))
    assert ours.shape == theirs.shape == (37, cols)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_half_scales_convert_exactly_subnormals_zeros_and_signs_included():
    """Q8_0 blocks whose fp16 scale is each interesting half value: w = q * d exposes d."""
    halves = np.array([0.0, -0.0, 6e-8, 3e-5, -3e-5, 1.0, -2.5, 65504.0], dtype=np.float16)
    blocks = np.zeros((len(halves), 34), dtype=np.uint8)
    blocks[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    ours = quant.dequantize(GGMLQuantizationType.Q8_0, torch.from_numpy(blocks), 32)
    theirs = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize(("n", "in_features", "out_features"), [
    (1, 640, 33), (7, 896, 96), (64, 640, 17), (3, 32, 5), (16, 576, 1536),
])  # fmt: skip
def test_exact_linear_is_the_dequantized_matmul(ggml_type, n, in_features, out_features):
    blocks = quantized(ggml_type, out_features, in_features, seed=n + in_features)
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(n))
    out = quant.linear(x, ggml_type, torch.from_numpy(blocks))
    expected = reference(x, blocks, ggml_type)
    assert out.shape == (n, out_features) and out.dtype == torch.float32
    # Only the summation order differs from the float64 product of the same weights.
    scale = x.double().abs() @ torch.from_numpy(dequantize(blocks, ggml_type)).double().abs().T
    assert ((out.double() - expected).abs() <= 1e-6 * scale + 1e-30).all()


def test_smollm2s_shipped_q4_1_tensors():
    """Real blocks: a projection of SmolLM2's Q4_1 file, as transformers would load it."""
    source = resolve_model("smollm2")
    reader = GGUFReader(f"{source.path}/{source.gguf_file}")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1
    in_features, out_features = (int(d) for d in tensor.shape)  # ggml lists the fastest first
    blocks = np.array(tensor.data).reshape(out_features, -1)  # a writable copy
    weights = torch.from_numpy(blocks)
    theirs = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_1))
    ours = quant.dequantize(GGMLQuantizationType.Q4_1, weights, in_features)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ theirs.double().T
    out = quant.linear(x, GGMLQuantizationType.Q4_1, weights)
    scale = x.double().abs() @ theirs.double().abs().T
    assert ((out.double() - expected).abs() <= 1e-6 * scale).all()


def test_bad_arguments_name_what_is_wrong():
    blocks = torch.from_numpy(quantized(GGMLQuantizationType.Q8_0, 4, 64, seed=1))
    x = torch.randn(2, 64)
    with pytest.raises(KernelArgumentError, match="ggml_type"):
        quant.linear(x, GGMLQuantizationType.Q6_K, blocks)  # no kernel (yet)
    with pytest.raises(KernelArgumentError, match="weight"):
        quant.linear(x, GGMLQuantizationType.Q4_0, blocks)  # Q8_0 rows, read as Q4_0
    with pytest.raises(KernelArgumentError, match="in_features"):
        quant.dequantize(GGMLQuantizationType.Q8_0, blocks, 48)
    with pytest.raises(KernelArgumentError, match="x"):
        quant.linear(x.double(), GGMLQuantizationType.Q8_0, blocks)
    with pytest.raises(KernelArgumentError, match="weight"):
        quant.linear(x, GGMLQuantizationType.Q8_0, blocks.float())
