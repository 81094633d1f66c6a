"""Fused projections whose parts differ in type (worker_service/models/gguf_widen.py): Q4_0 and
Q5_0 blocks widened to Q5_0 or Q8_0 dequantize, by the gguf package (transformers'
reference), to the same floats bit for bit; types without a lossless wider form have none."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from worker_service.models.gguf_widen import common_type, widen

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
)


def blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Quantized by the gguf package from weights with outliers, so every integer in the
    type's range occurs (the extremes included)."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    weights[rng.random((rows, cols)) < 0.05] *= 30
    return quantize(weights, ggml_type)


@pytest.mark.parametrize(("source", "target"), [(Q4_0, Q5_0), (Q4_0, Q8_0), (Q5_0, Q8_0)])
def test_widened_blocks_dequantize_to_the_same_floats(source, target):
    rows = blocks(source, 24, 640, seed=int(source) * 10 + int(target))
    wide = widen(int(source), rows, int(target))
    assert wide.dtype == np.uint8 and wide.shape == (24, 640 // 32 * {Q5_0: 22, Q8_0: 34}[target])
    theirs = dequantize(rows, source)
    ours = dequantize(wide, target)
    assert np.array_equal(ours.view(np.int32), theirs.view(np.int32))
    assert widen(int(source), rows, int(source)) is rows


def test_the_common_type_is_the_narrowest_that_holds_every_part():
    assert common_type({int(Q5_0), int(Q8_0)}) == Q8_0
    assert common_type({int(Q4_0), int(Q5_0)}) == Q5_0
    assert common_type({int(Q4_0), int(Q5_0), int(Q8_0)}) == Q8_0
    assert common_type({int(Q4_1), int(Q8_0)}) is None  # Q4_1's offsets: no wider form
    assert common_type({int(Q4_K), int(Q5_0)}) is None
