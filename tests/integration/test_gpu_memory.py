"""The worker's CUDA memory profile honours `gpu_memory_utilization` (SmolLM2 bfloat16)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from tests.integration.test_gpu_smollm2 import load_hf
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def hf16() -> Any:
    return load_hf(torch.bfloat16)


def profiled_worker(hf: Any, utilization: float, **config: Any) -> tuple[Worker, int]:
    worker = Worker(
        WorkerConfig(
            model="smollm2",
            dtype="bfloat16",
            device="cuda",
            gpu_memory_utilization=utilization,
            max_num_seqs=64,
            **config,
        )
    )
    worker.load_from_hf(hf)
    num_gpu, _ = worker.determine_num_available_blocks()
    return worker, num_gpu


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_device_use_stays_under_the_utilization(hf16: Any, enforce_eager: bool) -> None:
    """With the cache allocated (and graphs captured), a forward of the profile's shape
    keeps the device's used memory (every process's) under utilization x total, and the
    cache takes most of what the utilization allows beyond what the device held before (the
    CUDA context, HF's copy of the model, whatever earlier tests of this process left) and the
    worker's model."""
    utilization = 0.4
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held_before = total - free
    worker, num_gpu = profiled_worker(hf16, utilization, enforce_eager=enforce_eager)
    try:
        worker.initialize_cache(num_gpu, 0)
        worker._profile_run()  # the largest step the scheduler may send, on top of the cache
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        budget = utilization * total
        cache_bytes = num_gpu * worker.get_cache_block_size_bytes()
        assert total - free <= budget
        assert cache_bytes >= budget - held_before - 3 * (1 << 30)
        assert (worker.graph_memory_bytes > 0) == (not enforce_eager)
    finally:  # a failure's traceback would otherwise keep the cache for the next test
        del worker
        torch.cuda.empty_cache()


def test_blocks_follow_the_utilization(hf16: Any) -> None:
    """Raising the utilization by 0.2 adds 0.2 x total bytes of cache blocks (to 1%)."""
    worker, low = profiled_worker(hf16, 0.3, enforce_eager=True)
    _, high = profiled_worker(hf16, 0.5, enforce_eager=True)
    _, total = torch.cuda.mem_get_info()
    added = (high - low) * worker.get_cache_block_size_bytes()
    assert added == pytest.approx(0.2 * total, rel=0.01)
