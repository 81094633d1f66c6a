"""Weights kept in GGUF blocks (llmserve_kernels.cpu.quant) against the gguf package, the reference
transformers itself dequantizes GGUF files with: dequantized weights bit for bit, the
exact-mode linear against x @ dequantize(w).T in float64, and the fast mode against the same
product on activations rounded to 8 bits by a torch reference of the rounding. Blocks come
from the package's own quantizer, and from SmolLM2's shipped Q4_1 file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.gguf_files import open_gguf
from llmserve.model_spec import resolve_model
from llmserve_kernels import KernelArgumentError
from llmserve_kernels.cpu import quant

TYPES = [
    pytest.param(GGMLQuantizationType.Q4_0, id="q4_0"),
    pytest.param(GGMLQuantizationType.Q4_1, id="q4_1"),
    pytest.param(GGMLQuantizationType.Q8_0, id="q8_0"),
]


# Types the gguf package cannot quantize (it only dequantizes them): their blocks are random
# bytes with sane fp16 scales, at these byte offsets in the block.
K_QUANTS = {
    GGMLQuantizationType.Q4_K: (144, (0, 2)),
    GGMLQuantizationType.Q5_K: (176, (0, 2)),
    GGMLQuantizationType.Q6_K: (210, (208,)),
}
# Q5_0 and the k-quants, which the gguf package dequantizes but (Q5_0 aside) cannot quantize;
# fast mode reads the k-quants in chunks of 32 weights (quant_chunked.h), and Q5_0 as the other
# 32-weight types.
CHUNKED_TYPES = [
    pytest.param(GGMLQuantizationType.Q5_0, id="q5_0"),
    *(pytest.param(t, id=t.name.lower()) for t in K_QUANTS),
]


def widths(ggml_type: GGMLQuantizationType) -> list[int]:
    """Row widths to test: odd ones (640, 896: not multiples of 256) for the 32-weight
    blocks, multiples of 256 (all the k-quants allow)."""
    return [256, 512, 2048] if ggml_type in K_QUANTS else [32, 640, 896]


def quantized(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, cols / block weights * block bytes] uint8, from weights spread like a model's (a
    few large ones, so blocks' scales differ), quantized by the gguf package."""
    rng = np.random.default_rng(seed)
    if ggml_type in K_QUANTS:
        size, scale_offsets = K_QUANTS[ggml_type]
        blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for offset in scale_offsets:
            halves = (rng.standard_normal((rows, cols // 256)) * 0.01).astype(np.float16)
            blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
        return blocks.reshape(rows, -1)
    weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    weights[rng.random((rows, cols)) < 0.01] *= 40
    return quantize(weights, ggml_type)


def reference(x: torch.Tensor, blocks: np.ndarray, ggml_type: GGMLQuantizationType):
    w = torch.from_numpy(dequantize(blocks, ggml_type)).double()
    return x.double() @ w.T


@pytest.mark.parametrize("ggml_type", TYPES + CHUNKED_TYPES)
@pytest.mark.parametrize("width", [0, 1, 2])
def test_dequantized_weights_are_the_gguf_packages_bit_for_bit(ggml_type, width):
    cols = widths(ggml_type)[width]
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


@pytest.mark.parametrize("mode", quant.MODES)
@pytest.mark.parametrize("ggml_type", TYPES + CHUNKED_TYPES)
def test_a_row_gets_the_same_bits_whatever_it_is_batched_with(ggml_type, mode):
    """A speculative step's draft rows (and any decode batch) must give each token exactly
    what it gives alone, or drafts could change greedy output on a near-tie: every batch
    size, odd and even, over a row count that is not a multiple of the kernels' tiles."""
    in_features = widths(ggml_type)[1]
    blocks = torch.from_numpy(quantized(ggml_type, 35, in_features, seed=3))
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([quant.linear(x[i : i + 1], ggml_type, blocks, mode) for i in range(9)])
    for n in range(2, 10):
        assert torch.equal(quant.linear(x[:n], ggml_type, blocks, mode), alone[:n]), n


@pytest.mark.parametrize("ggml_type", CHUNKED_TYPES)
@pytest.mark.parametrize("n", [1, 5, 64])
def test_exact_linear_of_q5_0_and_k_quants_is_the_dequantized_matmul(ggml_type, n):
    in_features = widths(ggml_type)[n % 3]
    blocks = quantized(ggml_type, 48, in_features, seed=n)
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(n))
    expected = reference(x, blocks, ggml_type)
    scale = x.double().abs() @ torch.from_numpy(dequantize(blocks, ggml_type)).double().abs().T
    out = quant.linear(x, ggml_type, torch.from_numpy(blocks))
    assert ((out.double() - expected).abs() <= 1e-6 * scale + 1e-30).all()


def test_smollm2s_shipped_q4_1_tensors():
    """Real blocks: a projection of SmolLM2's Q4_1 file, as transformers would load it."""
    source = resolve_model("smollm2")
    reader = open_gguf(f"{source.path}/{source.gguf_file}")
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
        quant.linear(x, GGMLQuantizationType.IQ2_XXS, blocks)  # no kernel
    with pytest.raises(KernelArgumentError, match="in_features"):
        quant.dequantize(GGMLQuantizationType.Q4_K, blocks, 128)  # k-quant rows: 256s
    with pytest.raises(KernelArgumentError, match="weight"):
        quant.linear(x, GGMLQuantizationType.Q4_0, blocks)  # Q8_0 rows, read as Q4_0
    with pytest.raises(KernelArgumentError, match="in_features"):
        quant.dequantize(GGMLQuantizationType.Q8_0, blocks, 48)
    with pytest.raises(KernelArgumentError, match="x"):
        quant.linear(x.double(), GGMLQuantizationType.Q8_0, blocks)
    with pytest.raises(KernelArgumentError, match="weight"):
        quant.linear(x, GGMLQuantizationType.Q8_0, blocks.float())
    with pytest.raises(KernelArgumentError, match="mode"):
        quant.linear(x, GGMLQuantizationType.Q8_0, blocks, "fastest")  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="x"):
        quant.quantize_activations(torch.randn(2, 48))


def rounded_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fast mode's rounding written in torch: per block of 32, d = max|x| / 127 and
    q = round_half_even(x * (1 / d)) in float32; s = d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None])
    return d, d * q.sum(-1), q.to(torch.int8).reshape(x.shape)


def test_activations_round_to_8_bits_as_the_torch_reference_does():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 640, generator=gen) * torch.rand(9, 640, generator=gen) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[1, 32:64] = torch.tensor([-1.5, 0.5, 2.5] * 10 + [127.0, -127.0])  # ties round to even
    d, s, q = quant.quantize_activations(x)
    ref_d, ref_s, ref_q = rounded_activations(x)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)  # a float32 sum, its own order
    assert d[0, 0] == 0 and not q[0, :32].any()
    assert q.abs().max() == 127


FAST_SHAPES = [
    (1, 640, 33),
    (5, 896, 96),
    (64, 640, 17),
    (4, 32, 5),
    (16, 576, 1536),
    (8, 20480, 3),
]
# The k-quants' rows are multiples of 256 weights.
K_FAST_SHAPES = [(1, 256, 33), (5, 512, 96), (64, 2048, 17), (7, 768, 40), (8, 20480, 3)]


@pytest.mark.parametrize(
    ("ggml_type", "n", "in_features", "out_features"),
    [
        pytest.param(t.values[0], *shape, id=f"{t.id}-{'-'.join(map(str, shape))}")
        for t in TYPES + CHUNKED_TYPES
        for shape in (K_FAST_SHAPES if t.values[0] in K_QUANTS else FAST_SHAPES)
    ],
)
def test_fast_linear_is_the_product_on_8_bit_activations(ggml_type, n, in_features, out_features):
    """Every type, batch 1 to 64 (4-row tiles and their remainders), widths 640 and 896 (not
    multiples of 256) for the 32-weight types, and a row wider than exact mode's limit."""
    blocks = quantized(ggml_type, out_features, in_features, seed=n * 7 + in_features)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, in_features, generator=gen)
    x[:, :64] *= 30  # blocks with larger values than their neighbours
    out = quant.linear(x, ggml_type, torch.from_numpy(blocks), "fast")
    d, _, q = rounded_activations(x)
    rounded = (q.double().reshape(n, -1, 32) * d.double()[..., None]).reshape(n, in_features)
    expected = reference(rounded, blocks, ggml_type)
    assert out.shape == (n, out_features) and out.dtype == torch.float32
    w = torch.from_numpy(dequantize(blocks, ggml_type)).double()
    scale = rounded.abs() @ w.abs().T
    # Summation order only, but of larger terms: a 4-bit block sums d_w * q_w (q_w up to 15)
    # and its offset apart, which cancel to weights about 8 times smaller.
    assert ((out.double() - expected).abs() <= 1e-5 * scale + 1e-30).all()
    # ... and it is not exact mode: 8-bit activations move the product measurably.
    exact = reference(x, blocks, ggml_type)
    assert (out.double() - exact).abs().max() > 1e-4 * scale.max()


def test_rounded_activations_are_the_kernels_quants_times_their_scales():
    """round_activations: what fast mode's integer dots multiply, back in float32 (the
    dequantizing path's input in fast mode)."""
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(6)) * 4
    ref_d, _, ref_q = rounded_activations(x)
    expected = (ref_q.view(5, 20, 32).float() * ref_d[..., None]).view(5, 640)
    rounded = quant.round_activations(x)
    assert torch.equal(rounded, expected)
    assert not torch.equal(rounded, x)
    assert torch.equal(quant.round_activations(rounded), rounded)  # already on the grid
