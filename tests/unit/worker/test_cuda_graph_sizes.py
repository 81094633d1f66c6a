"""Which decode batch sizes the worker captures as CUDA graphs (the capture itself runs in
tests/integration/test_gpu_smollm2.py, on a GPU)."""

from __future__ import annotations

import pytest

from worker_service.cuda_graphs import capture_sizes


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [
        (0, []),
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
    ],
)
def test_capture_sizes(max_batch: int, sizes: list[int]) -> None:
    assert capture_sizes(max_batch) == sizes


def test_256_sequences_take_35_graphs() -> None:
    sizes = capture_sizes(256)
    assert len(sizes) == 35 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
