"""Which decode batch sizes the worker captures as CUDA graphs, and the flag that turns them
off (the capture itself runs on a GPU: tests/integration/test_gpu_smollm2.py)."""

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


def test_enforce_eager_reaches_the_worker_config() -> None:
    from worker_service.__main__ import build_config, parse_args

    assert build_config(parse_args([])).enforce_eager is False
    assert build_config(parse_args(["--enforce-eager"])).enforce_eager is True
