"""Fast mode on the matrix engine (llmserve_kernels/cpu/quant_amx.cpp): calls of enough rows
(`quant.matrix_engine_rows()`) on interleaved weights of every type but Q6_K go to AMX tiles where the CPU, the build and the OS
allow, with outputs bit for bit those of the interleaved kernel without it and of the file's
layout (which test_quant_linear.py holds against the float64 product of the rounded
activations). Where the engine cannot run, the same products are checked with it off, and the
tests that need it are skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType

from llmserve_kernels.cpu import build, quant
from tests.kernels.test_quant_interleaved import QUANT_BYTES, weight
from tests.kernels.test_quant_linear import K_QUANTS, TYPES, quantized

Q5_0, Q6_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K
K_ENGINE_TYPES = [
    pytest.param(GGMLQuantizationType.Q4_K, id="q4_k"),
    pytest.param(GGMLQuantizationType.Q5_K, id="q5_k"),
]
ENGINE_TYPES = [*TYPES, pytest.param(Q5_0, id="q5_0"), *K_ENGINE_TYPES]  # all but Q6_K
# Rows around the tile of 16 and its multiples: whole tiles, padded remainders, and (under
# matrix_engine_rows) counts the engine does not take.
ROWS = (15, 16, 17, 31, 32, 33, 47, 64, 100)

# Without AVX2 nothing is interleaved, so there is neither kernel to compare (as in
# test_quant_interleaved.py).
pytestmark = pytest.mark.skipif(
    not quant.interleaves(GGMLQuantizationType.Q4_0), reason="this build has no AVX2 kernels"
)


def has_amx() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return "amx_int8" in cpuinfo.read()


def emulated() -> bool:
    """Whether this is test_amx_emulated.py's build, whose tiles are a model in C++."""
    return "LLMSERVE_AMX_EMULATE" in os.environ.get(build.FLAGS_ENV, "")


# Tests that only mean something on the tiles (on a CPU without AMX, the CI's perhaps, the
# products test above still compares the vector kernel with the file layout).
needs_engine = pytest.mark.skipif(
    not build.set_matrix_engine(None), reason="no matrix engine here (CPU, build or OS)"
)


@pytest.fixture
def engine() -> Iterator[None]:
    """The test may turn the engine off; it is on again after."""
    yield
    build.set_matrix_engine(True)


def products(
    x: torch.Tensor, w: quant.QuantWeight, inter: quant.QuantWeight, on: bool
) -> tuple[torch.Tensor, int]:
    """The interleaved product with the engine on or off, and how many calls it took."""
    build.set_matrix_engine(on)
    before = build.matrix_engine_calls("linear")
    out = quant.linear(x, inter.code, inter.blocks, "fast")
    return out, build.matrix_engine_calls("linear") - before


@pytest.mark.parametrize("ggml_type", ENGINE_TYPES)
@pytest.mark.parametrize(
    ("in_32", "in_k", "out_features"), [(32, 256, 16), (640, 512, 48), (2048, 2048, 96)]
)
def test_products_are_the_file_layouts_bit_for_bit_with_and_without_the_engine(
    engine, ggml_type, in_32, in_k, out_features
):
    """in_32, in_k: the widths for the 32-weight types and for the k-quants."""
    in_features = in_k if ggml_type in K_QUANTS else in_32
    w = weight(ggml_type, out_features, in_features, seed=in_features + out_features)
    inter = quant.interleave(w)
    assert inter is not None
    x = torch.randn(max(ROWS), in_features, generator=torch.Generator().manual_seed(7))
    x[:, :32] *= 30
    x[3] = 0.0  # a row of zero activations (scale 0)
    available = build.set_matrix_engine(None)
    for n in ROWS:
        expected = quant.linear(x[:n], w.code, w.blocks, "fast")
        off, taken_off = products(x[:n], w, inter, on=False)
        on, taken_on = products(x[:n], w, inter, on=True)
        assert taken_off == 0
        assert taken_on == (1 if available and n >= quant.matrix_engine_rows() else 0), n
        assert torch.equal(off, expected), n
        assert torch.equal(on, expected), n


@needs_engine
@pytest.mark.parametrize("ggml_type", ENGINE_TYPES)
def test_the_widest_integer_sums_are_exact_on_the_engine(ggml_type):
    """Every weight quant at its largest (Q8_0: -128) against activation quants of +-127: the
    tiles' int32 dots give the file layout's bits."""
    in_features, out_features, n = 512, 32, quant.matrix_engine_rows() + 4
    blocks = quantized(ggml_type, out_features, in_features, seed=3)
    begin, end = QUANT_BYTES[ggml_type]
    # block bytes: the 32-weight types' quants end their blocks
    size = K_QUANTS[ggml_type][0] if ggml_type in K_QUANTS else end
    blocks.reshape(out_features, -1, size)[..., begin:end] = (
        0x80 if ggml_type == GGMLQuantizationType.Q8_0 else 0xFF
    )
    w = quant.QuantWeight(int(ggml_type), torch.from_numpy(blocks), in_features)
    inter = quant.interleave(w)
    assert inter is not None
    x = torch.ones(n, in_features)
    x[1::2] = -1.0
    before = build.matrix_engine_calls("linear")
    out = quant.linear(x, inter.code, inter.blocks, "fast")
    assert build.matrix_engine_calls("linear") == before + 1
    assert torch.equal(out, quant.linear(x, w.code, w.blocks, "fast"))


def test_what_the_engine_does_not_take(engine):
    """Q6_K, out features not a multiple of 16, and the file's layout stay off it."""
    x = torch.randn(quant.matrix_engine_rows(), 256, generator=torch.Generator().manual_seed(1))
    before = build.matrix_engine_calls("linear")
    q6_k = quant.interleave(weight(Q6_K, 16, 256, seed=1))
    assert q6_k is not None
    quant.linear(x, q6_k.code, q6_k.blocks, "fast")
    eight = quant.interleave(weight(GGMLQuantizationType.Q4_0, 24, 256, seed=1))
    assert eight is not None
    quant.linear(x, eight.code, eight.blocks, "fast")
    plain = weight(GGMLQuantizationType.Q4_0, 32, 256, seed=1)
    quant.linear(x, plain.code, plain.blocks, "fast")
    assert build.matrix_engine_calls("linear") == before


# Only a CPU that lists AMX can say whether the build and the OS gave us the engine.
@pytest.mark.skipif(not has_amx() and not emulated(), reason="the CPU lists no AMX")
def test_a_cpu_with_amx_runs_the_engine(engine):
    """Where the CPU lists AMX, this build (-march=native) has the path and the OS grants the
    tiles; turning it off and on is seen."""
    assert build.set_matrix_engine(None)
    assert not build.set_matrix_engine(False)
    assert not build.set_matrix_engine(None)
    assert build.set_matrix_engine(True)
