"""Where a GGUF block weight's product leaves the kernel for dequantize + torch
(worker_service.models.gguf_weights.dequantize_rows): fixed for large weights, measured once
per mode, weight type and shape otherwise."""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels.cpu import quant
from llmserve_kernels.cpu.quant import QuantWeight
from worker_service.models import gguf_weights
from worker_service.models.gguf_weights import (
    CROSSOVER_ROWS,
    LARGE_DEQUANTIZE_ROWS,
    NEVER_DEQUANTIZE,
    dequantize_rows,
    first_faster,
    time_both_paths,
)

Q8_0 = 8


def q8_0_weight(out_features: int, in_features: int) -> QuantWeight:
    blocks = torch.zeros(
        out_features, in_features // 32 * quant.block_bytes(Q8_0), dtype=torch.uint8
    )
    return QuantWeight(Q8_0, blocks, in_features)


def test_dequantizing_takes_over_where_it_is_faster_by_the_margin():
    kernel = {64: 1.0, 128: 2.0, 256: 4.0}
    assert first_faster(kernel, {64: 1.5, 128: 1.7, 256: 1.0}) == 128  # 1.7 < 0.9 * 2.0
    assert first_faster(kernel, {64: 0.95, 128: 1.95, 256: 3.9}) == NEVER_DEQUANTIZE
    assert first_faster({}, {}) == NEVER_DEQUANTIZE
    # Only sizes both paths were timed at count.
    assert first_faster({64: 1.0, 128: 2.0}, {128: 1.0}) == 128


@pytest.fixture
def timings(monkeypatch):
    """time_both_paths replaced by a fake that counts its calls and answers `answer`."""
    calls: list[tuple[tuple[int, int], str]] = []
    crossovers = {"fast": 128, "exact": 256}

    def fake(weight, mode):
        calls.append((weight.shape, mode))
        kernel = {rows: 1.0 for rows in CROSSOVER_ROWS}
        return kernel, {rows: 0.5 if rows >= crossovers[mode] else 2.0 for rows in kernel}

    monkeypatch.setattr(gguf_weights, "time_both_paths", fake)
    monkeypatch.setattr(gguf_weights, "_crossover", {})
    return calls


def test_each_mode_type_and_shape_is_measured_once(timings):
    first, same_shape, other = q8_0_weight(64, 128), q8_0_weight(64, 128), q8_0_weight(32, 128)
    assert dequantize_rows(first, "fast") == 128
    assert dequantize_rows(same_shape, "fast") == 128
    assert timings == [((64, 128), "fast")]
    dequantize_rows(other, "fast")
    assert timings == [((64, 128), "fast"), ((32, 128), "fast")]
    # Exact mode's kernel is another kernel: measured apart, its own crossover.
    assert dequantize_rows(first, "exact") == 256
    assert dequantize_rows(same_shape, "exact") == 256
    assert timings[2:] == [((64, 128), "exact")]


def test_large_weights_use_a_fixed_count_unmeasured(timings):
    large = q8_0_weight(gguf_weights.LARGE_WEIGHT_BYTES // (4 * 64) + 1, 64)
    assert dequantize_rows(large, "fast") == LARGE_DEQUANTIZE_ROWS
    assert dequantize_rows(large, "exact") == LARGE_DEQUANTIZE_ROWS
    assert timings == []


@pytest.mark.parametrize("mode", quant.MODES)
def test_the_measurement_times_both_paths_at_the_same_sizes_up_to_the_crossover(mode):
    kernel, dequantizing = time_both_paths(q8_0_weight(32, 64), mode)
    assert list(kernel) == list(dequantizing) == list(CROSSOVER_ROWS[: len(kernel)])
    assert all(t > 0 for t in (*kernel.values(), *dequantizing.values()))
    # It stopped at the crossover it found, or measured every size.
    found = first_faster(kernel, dequantizing)
    assert found == list(kernel)[-1] or (
        found == NEVER_DEQUANTIZE and len(kernel) == len(CROSSOVER_ROWS)
    )
