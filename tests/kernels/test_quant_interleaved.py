"""Fast mode on interleaved weights (llmserve_kernels/cpu/quant_interleaved.cpp, and .h for the
k-quants): the layouts their file comments describe, written here in numpy; products bit for
bit those of the file's layout (which test_quant_linear.py holds against the float64 product
of the rounded activations); dequantizing an interleaved weight; the weights and modes it
refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from llmserve.gguf_files import open_gguf
from llmserve.model_spec import resolve_model
from llmserve_kernels import KernelArgumentError
from llmserve_kernels.cpu import quant
from tests.kernels.test_quant_linear import (
    CHUNKED_TYPES,
    K_QUANTS,
    TYPES,
    quantized,
    reference,
    rounded_activations,
)

ROWS = quant.INTERLEAVE_ROWS
Q5_0, Q6_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K
INTERLEAVED_TYPES = TYPES + CHUNKED_TYPES  # all of them


def fifth_bit_plane(per_row: np.ndarray) -> np.ndarray:
    """Q5_0's fifth bits [g, b, r, 22 bytes] as the group's 32-byte plane: bit j of byte
    4r + i is that of row r's weight 4j + i (j < 4) or 16 + 4(j - 4) + i."""
    high = per_row[..., 2:6].copy().view("<u4")[..., 0]  # [g, b, r]
    plane = np.zeros((*high.shape, 4), dtype=np.uint8)
    for j in range(8):
        first = 4 * j if j < 4 else 16 + 4 * (j - 4)
        for i in range(4):
            plane[..., i] |= (((high >> (first + i)) & 1) << j).astype(np.uint8)
    return plane.reshape(*high.shape[:2], -1)


def lanes(run: np.ndarray) -> np.ndarray:
    """Row bytes [g, b, r, n] as chunks of 32 bytes whose 4-byte lane r holds row r's bytes
    4k .. 4k + 3: [g, b, n * 8]."""
    quants = run.reshape(*run.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [g, b, k, r, 4]
    return quants.reshape(*run.shape[:2], -1)


def scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8], as the
    gguf package unpacks them."""
    p = packed.astype(np.int32)
    sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 15) | (p[..., 0:4] >> 6) << 4], -1)
    m = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | (p[..., 4:8] >> 6) << 4], -1)
    return sc, m


def k_interleaved_in_numpy(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """quant_interleaved.h's k-quant layout written out: per group of 8 rows and super-block,
    the rows' fp16 d (and dmin), their scales (Q6_K's int8 ones by sub-block of 16, then row;
    Q4_K's and Q5_K's 6-bit ones as three planes indexed 8 * sub-block + row), then the rest
    by lanes."""
    rows, size = blocks.shape[0], K_QUANTS[ggml_type][0]
    per_row = blocks.reshape(rows // ROWS, ROWS, -1, size).transpose(0, 2, 1, 3)  # [g, b, r, bytes]
    g, b = per_row.shape[:2]
    if ggml_type == Q6_K:
        d = per_row[..., 208:210].reshape(g, b, -1)
        scales = per_row[..., 192:208].transpose(0, 1, 3, 2).reshape(g, b, -1)
        return np.concatenate([d, scales, lanes(per_row[..., :192])], -1).reshape(rows, -1)
    d = per_row[..., 0:2].reshape(g, b, -1)
    dmin = per_row[..., 2:4].reshape(g, b, -1)
    sc, m = scales_and_mins(per_row[..., 4:16])  # [g, b, r, c]
    sc, m = sc.transpose(0, 1, 3, 2).reshape(g, b, 64), m.transpose(0, 1, 3, 2).reshape(g, b, 64)
    planes = [
        (sc[..., :32] & 15) | (sc[..., 32:] & 15) << 4,
        (m[..., :32] & 15) | (m[..., 32:] & 15) << 4,
        sc[..., :32] >> 4
        | (sc[..., 32:] >> 4) << 2
        | (m[..., :32] >> 4) << 4
        | (m[..., 32:] >> 4) << 6,
    ]
    header = [d, dmin, *(plane.astype(np.uint8) for plane in planes)]
    return np.concatenate([*header, lanes(per_row[..., 16:])], -1).reshape(rows, -1)


def interleaved_in_numpy(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The layout written out: per group of 8 rows and per block, the rows' fp16 scales (and
    Q4_1's minimums, or Q5_0's plane of fifth bits), then chunks of 32 bytes whose 4-byte
    lane r holds row r's quant bytes 4k .. 4k + 3."""
    if ggml_type in K_QUANTS:
        return k_interleaved_in_numpy(blocks, ggml_type)
    rows = blocks.shape[0]
    size = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, Q5_0: 22}.get(
        ggml_type, 34
    )
    halves = 4 if ggml_type == GGMLQuantizationType.Q4_1 else 2  # d, and Q4_1's m
    header = 6 if ggml_type == Q5_0 else halves
    per_row = blocks.reshape(rows // ROWS, ROWS, -1, size).transpose(0, 2, 1, 3)  # [g, b, r, bytes]
    scales = per_row[..., :halves].reshape(*per_row.shape[:2], ROWS, -1, 2)  # [g, b, r, (d, m), 2]
    scales = scales.transpose(0, 1, 3, 2, 4).reshape(*per_row.shape[:2], -1)  # all d, then all m
    parts = [scales, fifth_bit_plane(per_row)] if ggml_type == Q5_0 else [scales]
    return np.concatenate([*parts, lanes(per_row[..., header:])], axis=-1).reshape(rows, -1)


def weight(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> quant.QuantWeight:
    return quant.QuantWeight(
        int(ggml_type), torch.from_numpy(quantized(ggml_type, rows, cols, seed)), cols
    )


pytestmark = pytest.mark.skipif(
    not quant.interleaves(GGMLQuantizationType.Q4_0), reason="this build has no AVX2 kernels"
)


@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES)
def test_the_layout_is_the_documented_one_and_dequantizes_to_the_same_weights(ggml_type):
    cols = 512 if ggml_type in K_QUANTS else 640
    w = weight(ggml_type, 24, cols, seed=1)
    inter = quant.interleave(w)
    assert inter is not None and inter.interleaved and inter.shape == w.shape
    assert inter.code == int(ggml_type) | quant.INTERLEAVED
    assert np.array_equal(inter.blocks.numpy(), interleaved_in_numpy(w.blocks.numpy(), ggml_type))
    assert torch.equal(w.blocks, torch.from_numpy(quantized(ggml_type, 24, cols, seed=1)))  # kept
    assert torch.equal(
        quant.dequantize(inter.code, inter.blocks, cols),
        quant.dequantize(w.code, w.blocks, cols),
    )


@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES)
@pytest.mark.parametrize(
    ("in_32", "in_k", "out_features"),
    [(32, 256, 8), (640, 512, 40), (896, 2048, 64), (20480, 20480, 16)],
)
def test_fast_products_are_the_file_layouts_bit_for_bit(ggml_type, in_32, in_k, out_features):
    """Every batch size from 1 to 9 (the kernel's 4-row tiles and remainders) and one of 64:
    the same bits as the file's layout, so interleaving changes no token; and the product of
    the rounded activations up to summation order. in_32, in_k: the widths for the 32-weight
    types and for the k-quants."""
    in_features = in_k if ggml_type in K_QUANTS else in_32
    w = weight(ggml_type, out_features, in_features, seed=in_features + out_features)
    inter = quant.interleave(w)
    assert inter is not None
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(in_features))
    x[:, :32] *= 30
    for n in [*range(1, 10), 64]:
        out = quant.linear(x[:n], inter.code, inter.blocks, "fast")
        assert torch.equal(out, quant.linear(x[:n], w.code, w.blocks, "fast")), n
    d, _, q = rounded_activations(x)
    rounded = (q.double().reshape(64, -1, 32) * d.double()[..., None]).reshape(64, in_features)
    expected = reference(rounded, w.blocks.numpy(), ggml_type)
    w_abs = quant.dequantize(w.code, w.blocks, in_features).double().abs()
    assert ((out.double() - expected).abs() <= 1e-5 * (rounded.abs() @ w_abs.T) + 1e-30).all()


# Each type's bytes of a block that hold its quants (Q5's fifth bits included): all ones, every
# quant is the type's largest unsigned one (Q6_K: 63; Q8_0: 0x80 = -128, the largest magnitude).
QUANT_BYTES = {
    GGMLQuantizationType.Q4_0: (2, 18),
    GGMLQuantizationType.Q4_1: (4, 20),
    Q5_0: (2, 22),
    GGMLQuantizationType.Q8_0: (2, 34),
    GGMLQuantizationType.Q4_K: (16, 144),
    GGMLQuantizationType.Q5_K: (16, 176),
    Q6_K: (0, 192),
}


@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES)
def test_the_widest_integer_sums_are_exact(ggml_type):
    """Every weight quant at its largest against activation blocks whose quants are all 127 or
    all -127: the integer dots at their widest (without VNNI several `vpmaddubsw` results add
    up in 16 bits first) still give the file layout's bits and the float64 product."""
    in_features, out_features = 512, 16
    blocks = quantized(ggml_type, out_features, in_features, seed=3)
    # block bytes: the 32-weight types' quants end their blocks
    size = K_QUANTS[ggml_type][0] if ggml_type in K_QUANTS else QUANT_BYTES[ggml_type][1]
    begin, end = QUANT_BYTES[ggml_type]
    per_block = blocks.reshape(out_features, -1, size)
    per_block[..., begin:end] = 0x80 if ggml_type == GGMLQuantizationType.Q8_0 else 0xFF
    w = quant.QuantWeight(int(ggml_type), torch.from_numpy(blocks), in_features)
    inter = quant.interleave(w)
    assert inter is not None
    x = torch.ones(9, in_features)
    x[1::2] = -1.0  # rows of +1 and -1: every activation quant is 127 or -127
    x[4, 100] = 0.5  # and one block with a smaller quant
    out = quant.linear(x, inter.code, inter.blocks, "fast")
    for n in range(1, 10):
        assert torch.equal(quant.linear(x[:n], inter.code, inter.blocks, "fast"), out[:n]), n
    assert torch.equal(out, quant.linear(x, w.code, w.blocks, "fast"))
    d, _, q = rounded_activations(x)
    assert q.abs().max() == 127
    rounded = (q.double().reshape(9, -1, 32) * d.double()[..., None]).reshape(9, in_features)
    expected = reference(rounded, blocks, ggml_type)
    w_abs = quant.dequantize(w.code, w.blocks, in_features).double().abs()
    assert ((out.double() - expected).abs() <= 1e-5 * (rounded.abs() @ w_abs.T) + 1e-30).all()


def assert_file_tensor_interleaves_exactly(tensor: Any, x: torch.Tensor) -> None:
    """A GGUF file's tensor, interleaved, multiplies `x` bit for bit as in the file's layout."""
    in_features, out_features = (int(d) for d in tensor.shape)
    rows = torch.from_numpy(np.array(tensor.data).reshape(out_features, -1))
    w = quant.QuantWeight(int(tensor.tensor_type), rows, in_features)
    inter = quant.interleave(w)
    assert inter is not None, tensor.name
    expected = quant.linear(x, w.code, w.blocks, "fast")
    assert torch.equal(quant.linear(x, inter.code, inter.blocks, "fast"), expected), tensor.name


def test_smollm2s_shipped_tensors_interleaved():
    """The shipped file's Q4_1 projection and its Q8_0 embedding (SmolLM2's tied LM head)."""
    source = resolve_model("smollm2")
    tensors = {t.name: t for t in open_gguf(f"{source.path}/{source.gguf_file}").tensors}
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    for name in ("blk.0.ffn_gate.weight", "token_embd.weight"):
        assert_file_tensor_interleaves_exactly(tensors[name], x)


def test_gemma3s_shipped_tensors_interleaved():
    """Gemma 3 270M's Q4_K_M file (the dev dependency): one tensor of each type it holds (Q5_0,
    Q4_K, Q6_K, Q8_0), with the file's own scales and mins."""
    source = resolve_model("gemma3-270m")
    firsts: dict[int, Any] = {}
    for tensor in open_gguf(f"{source.path}/{source.gguf_file}").tensors:
        if tensor.name.startswith("blk.") and quant.block_bytes(int(tensor.tensor_type)):
            firsts.setdefault(int(tensor.tensor_type), tensor)
    assert sorted(GGMLQuantizationType(t).name for t in firsts) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    for ggml_type, tensor in firsts.items():
        x = torch.randn(9, int(tensor.shape[0]), generator=torch.Generator().manual_seed(ggml_type))
        assert_file_tensor_interleaves_exactly(tensor, x)


def test_what_is_not_interleaved_and_bad_uses():
    assert quant.interleave(weight(GGMLQuantizationType.Q8_0, 12, 64, seed=2)) is None  # 12 rows
    q2_k = quant.QuantWeight(
        int(GGMLQuantizationType.Q2_K), torch.zeros(8, 84, dtype=torch.uint8), 256
    )
    assert quant.interleave(q2_k) is None  # no kernel
    inter = quant.interleave(weight(GGMLQuantizationType.Q4_1, 16, 64, seed=3))
    assert inter is not None and quant.interleave(inter) is None  # already
    x = torch.randn(2, 64)
    with pytest.raises(KernelArgumentError, match="mode"):
        quant.linear(x, inter.code, inter.blocks, "exact")
    with pytest.raises(KernelArgumentError, match="weight"):  # a group cut short
        quant.linear(x, inter.code, inter.blocks[:12].contiguous(), "fast")
