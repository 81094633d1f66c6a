"""Which dtype the worker's K/V cache takes (`WorkerConfig.kv_cache_dtype`)."""

from __future__ import annotations

import pytest
import torch

from worker_service.config import WorkerConfig, WorkerConfigError


def test_auto_is_bfloat16_only_in_fast_mode_on_blocks_with_the_cpu_backend() -> None:
    fast = WorkerConfig(quant_mode="fast")
    assert fast.resolve_kv_cache_dtype(torch.float32, "cpu", "gguf") == torch.bfloat16
    assert fast.resolve_kv_cache_dtype(torch.float32, "torch", "gguf") == torch.float32
    assert fast.resolve_kv_cache_dtype(torch.float32, "cpu", "onednn") == torch.float32
    exact = WorkerConfig(quant_mode="exact")
    assert exact.resolve_kv_cache_dtype(torch.float32, "cpu", "gguf") == torch.float32
    assert fast.resolve_kv_cache_dtype(torch.bfloat16, "triton", "torch") == torch.bfloat16


def test_model_keeps_the_model_dtype_and_bfloat16_needs_a_float32_model_on_the_cpu_backend() -> (
    None
):
    kept = WorkerConfig(kv_cache_dtype="model", quant_mode="fast")
    assert kept.resolve_kv_cache_dtype(torch.float32, "cpu", "gguf") == torch.float32
    asked = WorkerConfig(kv_cache_dtype="bfloat16")
    assert asked.resolve_kv_cache_dtype(torch.float32, "cpu", "native") == torch.bfloat16
    assert asked.resolve_kv_cache_dtype(torch.bfloat16, "triton", "torch") == torch.bfloat16
    with pytest.raises(WorkerConfigError, match="kv_cache_dtype.*cpu attention backend"):
        asked.resolve_kv_cache_dtype(torch.float32, "torch", "torch")
    with pytest.raises(WorkerConfigError, match="kv_cache_dtype.*float16"):
        asked.resolve_kv_cache_dtype(torch.float16, "cpu", "torch")


def test_an_unknown_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(WorkerConfigError, match="kv_cache_dtype.*auto\\|model\\|bfloat16"):
        WorkerConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]
